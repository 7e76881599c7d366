DROP TABLE IF EXISTS mcp_catalog.servers;
