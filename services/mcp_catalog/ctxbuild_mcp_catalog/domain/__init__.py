"""Pure MCP catalog logic: tool ids, modes and server selection, cache freshness, tool outputs. No I/O."""
