"""I/O edges of the MCP catalog: MCP client sessions (stdio) and the tool cache."""
