DROP INDEX IF EXISTS persistence.messages_clear_idx;
ALTER TABLE persistence.messages DROP COLUMN IF EXISTS clear_context;
ALTER TABLE persistence.messages DROP COLUMN IF EXISTS size_bytes;
ALTER TABLE persistence.events DROP COLUMN IF EXISTS size_bytes;
