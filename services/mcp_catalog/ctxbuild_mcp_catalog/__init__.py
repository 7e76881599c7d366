"""MCP catalog service: MCP clients, tool cache, resolution, invocation"""
