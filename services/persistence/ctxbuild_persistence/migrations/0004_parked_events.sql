-- Events the projector cannot apply are parked, not retried forever (SPEC §15.3): one row per parked event, and
-- the projection moves past it. History for a conversation with a parked event is folded from the events.
--
-- messages.size_bytes / clear_context stop being generated columns: a json expression (`body -> …`) fails on
-- a body holding a \u0000 escape anywhere ("\u0000 cannot be converted to text"), so one tool output with a NUL
-- character made the whole row impossible to insert. The projector now computes both from the body it writes
-- (domain/projection.py, same values); DROP EXPRESSION keeps the values already stored.
-- depends: 0003_read_budget

ALTER TABLE persistence.messages ALTER COLUMN size_bytes DROP EXPRESSION;
ALTER TABLE persistence.messages ALTER COLUMN clear_context DROP EXPRESSION;
ALTER TABLE persistence.messages ALTER COLUMN size_bytes SET NOT NULL;
ALTER TABLE persistence.messages ALTER COLUMN clear_context SET NOT NULL;

CREATE TABLE IF NOT EXISTS persistence.parked_events (
    position   bigint      PRIMARY KEY,       -- the event's global position (persistence.events)
    event_id   uuid        NOT NULL,
    stream_id  text        NOT NULL,
    type       text        NOT NULL,
    reason     text        NOT NULL,          -- why the projection could not apply it
    parked_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS parked_events_stream_idx ON persistence.parked_events (stream_id);
