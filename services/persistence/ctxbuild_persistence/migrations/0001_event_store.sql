-- Event store + transactional outbox (schema `persistence`, owned by the persistence service only).
--
-- events.position is the global order. Appends are serialized with a transaction-level advisory lock
-- (adapters/event_store.py), so positions are handed out in commit order: a reader paging by position never
-- skips an event that commits later with a smaller position. That only holds with the default sequence
-- CACHE 1 — do not raise it.
--
-- data/metadata are `json`, not `jsonb`: json keeps the caller's bytes (key order, \u0000 escapes) so a stored
-- message or tool output renders back byte-identically (SPEC §7, prompt-cache stability). Cast to jsonb in
-- queries when needed.

CREATE TABLE IF NOT EXISTS persistence.events (
    position     bigserial   PRIMARY KEY,
    stream_id    text        NOT NULL,
    version      integer     NOT NULL CHECK (version >= 1),
    event_id     uuid        NOT NULL,
    type         text        NOT NULL,
    data         json        NOT NULL,
    metadata     json        NOT NULL DEFAULT '{}',
    recorded_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT events_event_id_key UNIQUE (event_id),
    CONSTRAINT events_stream_version_key UNIQUE (stream_id, version)
);

-- one row per event, written in the append's transaction; the relay publishes and marks it
CREATE TABLE IF NOT EXISTS persistence.outbox (
    position      bigint      PRIMARY KEY REFERENCES persistence.events (position),
    created_at    timestamptz NOT NULL DEFAULT now(),
    published_at  timestamptz,
    attempts      integer     NOT NULL DEFAULT 0,
    last_error    text,
    js_sequence   bigint
);

CREATE INDEX IF NOT EXISTS outbox_pending_idx ON persistence.outbox (position) WHERE published_at IS NULL;
