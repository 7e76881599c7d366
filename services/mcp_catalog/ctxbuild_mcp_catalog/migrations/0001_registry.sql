-- MCP server registry. The tool cache itself lives in a NATS KV bucket shared by the replicas; this table is the
-- durable part: which servers exist (config), where they came from, and the last tool-list fingerprint announced
-- (so a change notification is published only on a real change, even after the cache was lost).
CREATE SCHEMA IF NOT EXISTS mcp_catalog;

CREATE TABLE mcp_catalog.servers (
    id                 text PRIMARY KEY CHECK (length(id) BETWEEN 1 AND 200),
    seq                bigserial NOT NULL,            -- registry order (the `auto` pool's order)
    config             jsonb NOT NULL,
    source             text NOT NULL CHECK (source IN ('env', 'api')),
    seed_hash          text,                          -- hash of the CTX_MCP_SERVERS entry last applied
    tools_fingerprint  text,                          -- last announced tool list (sha256), NULL = none yet
    revision           bigint NOT NULL DEFAULT 1,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX servers_seq_idx ON mcp_catalog.servers (seq);
