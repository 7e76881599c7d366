DROP TABLE IF EXISTS persistence.parked_events;
ALTER TABLE persistence.messages DROP COLUMN IF EXISTS size_bytes;
ALTER TABLE persistence.messages DROP COLUMN IF EXISTS clear_context;
ALTER TABLE persistence.messages ADD COLUMN size_bytes integer
    GENERATED ALWAYS AS (octet_length(body::text)
                         + coalesce((replace(body::text, '\u0000', '\u0001')::json
                                     -> 'parts' -> 'contentRef' ->> 'size')::integer, 0)) STORED;
ALTER TABLE persistence.messages ADD COLUMN clear_context boolean
    GENERATED ALWAYS AS (coalesce((replace(body::text, '\u0000', '\u0001')::json ->> 'clearContext')::boolean,
                                  false)) STORED;
CREATE INDEX IF NOT EXISTS messages_clear_idx ON persistence.messages (conversation_id, seq) WHERE clear_context;
