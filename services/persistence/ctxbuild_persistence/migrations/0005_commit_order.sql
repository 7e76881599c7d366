-- Commit-order reading without a global append lock (issue #21; docs/ARCHITECTURE.md, "Events").
--
-- Appends no longer serialize on an advisory lock. `position` stays the event's unique id (bigserial: increasing
-- per transaction, but it may have gaps and transactions may commit out of position order). Each row now records
-- the id of the transaction that wrote it (`tx`, xid8: 64 bits, never wraps). The global log is ordered by
-- (tx, position), and a reader only looks at rows whose tx is below the oldest transaction still running in its
-- snapshot: every transaction below it has ended, so nothing can later appear before what was read.
--
-- Existing rows all get this migration's transaction id (a volatile default is evaluated for each existing row,
-- inside this transaction), which is above every earlier writer's: a saved cursor (the position of the last event
-- read, its tx looked up) keeps meaning "everything up to that position" for the rows written before.
-- depends: 0004_parked_events

ALTER TABLE persistence.events ADD COLUMN IF NOT EXISTS tx xid8 NOT NULL DEFAULT pg_current_xact_id();
CREATE INDEX IF NOT EXISTS events_commit_order_idx ON persistence.events (tx, position);
