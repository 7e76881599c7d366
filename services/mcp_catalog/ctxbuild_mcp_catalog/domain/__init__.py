"""Pure MCP catalog logic: tool ids, modes and server selection, cache freshness, tool outputs, wire schemas per
dialect, deferral, the meta-tools. No I/O."""
