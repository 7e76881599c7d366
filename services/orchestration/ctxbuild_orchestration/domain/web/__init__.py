"""The web tools' pure parts: what a page or a search answer becomes, the specs, the outputs."""
