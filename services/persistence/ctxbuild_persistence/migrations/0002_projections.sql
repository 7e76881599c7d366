-- Projections of the conversation streams (rebuildable from persistence.events at any time:
-- `python -m ctxbuild_persistence rebuild-projections`), and the tracking table that makes them exactly-once.
--
-- The projector reads events by global position and, in ONE transaction, writes the rows below and moves its
-- row in projection_tracking. A crash before the commit loses both, a crash after keeps both: an event is never
-- applied twice or skipped. Every value here derives from events only (positions, not now()), so a rebuild
-- gives the same rows as the live projector.
-- depends: 0001_event_store

CREATE TABLE IF NOT EXISTS persistence.projection_tracking (
    name        text        PRIMARY KEY,
    position    bigint      NOT NULL DEFAULT 0 CHECK (position >= 0),  -- last global position applied
    updated_at  timestamptz NOT NULL DEFAULT now(),
    last_error  text
);
INSERT INTO persistence.projection_tracking (name) VALUES ('conversation') ON CONFLICT (name) DO NOTHING;

-- one row per conversation stream that has at least one event
CREATE TABLE IF NOT EXISTS persistence.conversations (
    conversation_id   text    PRIMARY KEY,
    version           integer NOT NULL,            -- stream version the rows are at
    first_position    bigint  NOT NULL,
    last_position     bigint  NOT NULL,
    created           boolean NOT NULL DEFAULT false,
    title             text,
    settings          json,
    last_message_id   text,                        -- default anchor; parent of a message without parentId
    message_count     integer NOT NULL DEFAULT 0,
    attachment_count  integer NOT NULL DEFAULT 0
);

-- the conversation tree: messages with the same parent are siblings (regenerate)
CREATE TABLE IF NOT EXISTS persistence.messages (
    conversation_id  text    NOT NULL,
    message_id       text    NOT NULL,
    seq              integer NOT NULL,             -- fold order inside the conversation, from 1
    parent_id        text,                         -- resolved (a message without the key hangs under the previous)
    role             text    NOT NULL,
    turn_id          text,
    body             json    NOT NULL,             -- the message as served, exact bytes and key order
    usage            json,                         -- provider usage of an assistant step, when reported
    position         bigint  NOT NULL,             -- the event that added it
    PRIMARY KEY (conversation_id, message_id),
    CONSTRAINT messages_seq_key UNIQUE (conversation_id, seq)
);
CREATE INDEX IF NOT EXISTS messages_parent_idx ON persistence.messages (conversation_id, parent_id, seq);

-- durable compaction summaries, written once at their boundary message (the first one per boundary wins)
CREATE TABLE IF NOT EXISTS persistence.compaction_summaries (
    conversation_id  text    NOT NULL,
    boundary_id      text    NOT NULL,
    summary          text    NOT NULL,
    turn_id          text,
    summarizer       text,
    folded_count     integer,
    position         bigint  NOT NULL,
    PRIMARY KEY (conversation_id, boundary_id)
);

-- the authoritative attachment list (SPEC §6/§8): first AttachmentAdded per handle wins
CREATE TABLE IF NOT EXISTS persistence.attachments (
    conversation_id  text    NOT NULL,
    handle           text    NOT NULL,
    seq              integer NOT NULL,
    sha256           text    NOT NULL,
    display_name     text    NOT NULL,
    media_type       text    NOT NULL,
    size             bigint  NOT NULL,
    uri              text,
    position         bigint  NOT NULL,
    PRIMARY KEY (conversation_id, handle)
);

-- which message refers to which file: attachments (file parts, by handle) and archived tool outputs
-- (`offload.uri` of in-flight trims, `vfsFilename` of persisted v1/v2 envelopes), typed provenance only
CREATE TABLE IF NOT EXISTS persistence.file_references (
    conversation_id  text    NOT NULL,
    message_id       text    NOT NULL,
    kind             text    NOT NULL CHECK (kind IN ('attachment', 'tool_output')),
    ref              text    NOT NULL,             -- attachment handle, or context://vfs/vfs_<16 hex>.txt
    sha256           text,
    tool_call_id     text,
    position         bigint  NOT NULL,
    PRIMARY KEY (conversation_id, message_id, kind, ref)
);
CREATE INDEX IF NOT EXISTS file_references_ref_idx ON persistence.file_references (conversation_id, kind, ref);
