-- Reads paged by bytes, and a turn-start read that walks only the window (SPEC §15.1).
--
-- size_bytes: the JSON text size of an event (data + metadata) and of a message row (its body, plus the size of
-- parts stored by content reference, which history resolves before replying). Computed once at insert, so a
-- read can cut a page at a byte budget with a running sum over these small columns instead of reading (and
-- detoasting) every event's data first. Adding a stored generated column rewrites the table once.
-- clear_context: the message is a clear-context marker (the history walk of a turn start stops there).
-- Both read the body through replace(… '\u0000' …): a json operator on a body holding a \u0000 escape
-- anywhere fails ("\u0000 cannot be converted to text"), and adding the columns computes them for
-- every row already projected (a tool output with a NUL character). Migration 0004 makes them plain.
-- depends: 0002_projections

ALTER TABLE persistence.events ADD COLUMN IF NOT EXISTS size_bytes integer
    GENERATED ALWAYS AS (octet_length(data::text) + octet_length(metadata::text)) STORED;

ALTER TABLE persistence.messages ADD COLUMN IF NOT EXISTS size_bytes integer
    GENERATED ALWAYS AS (octet_length(body::text)
                         + coalesce((replace(body::text, '\u0000', '\u0001')::json
                                     -> 'parts' -> 'contentRef' ->> 'size')::integer, 0)) STORED;
ALTER TABLE persistence.messages ADD COLUMN IF NOT EXISTS clear_context boolean
    GENERATED ALWAYS AS (coalesce((replace(body::text, '\u0000', '\u0001')::json ->> 'clearContext')::boolean,
                                  false)) STORED;

-- is a clear-context marker older than the window's boundary? (rare rows: a small partial index)
CREATE INDEX IF NOT EXISTS messages_clear_idx ON persistence.messages (conversation_id, seq) WHERE clear_context;
