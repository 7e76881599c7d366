"""The `ctxbuild` command line (typer + rich) over the orchestration HTTP API."""
