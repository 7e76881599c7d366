-- Blob store schema: object bytes live in S3 under blobs/<sha256>; this is metadata and references.
CREATE SCHEMA IF NOT EXISTS blobstore;

-- One row per distinct content (identity = full sha256 of the UTF-8 bytes).
CREATE TABLE blobstore.blobs (
    sha256      text PRIMARY KEY CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    -- the vfs_<16 hex> handle: only a name, so it is indexed but NOT unique (collisions must be detectable)
    prefix      text GENERATED ALWAYS AS (left(sha256, 16)) STORED,
    size        bigint NOT NULL CHECK (size >= 0),
    chars       bigint NOT NULL CHECK (chars >= 0),
    media_type  text NOT NULL DEFAULT 'text/plain',
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX blobs_prefix_idx ON blobstore.blobs (prefix);

-- Who keeps a blob alive, and which conversation may read it (the allow-list).
CREATE TABLE blobstore.refs (
    id               bigserial PRIMARY KEY,
    sha256           text NOT NULL REFERENCES blobstore.blobs (sha256),
    owner_kind       text NOT NULL CHECK (owner_kind IN ('turn', 'message', 'conversation')),
    owner_id         text NOT NULL,
    role             text NOT NULL CHECK (role IN ('tool_output', 'attachment', 'provisional')),
    conversation_id  text NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    UNIQUE (sha256, owner_kind, owner_id, role)
);
CREATE INDEX refs_conversation_idx ON blobstore.refs (conversation_id, sha256);
CREATE INDEX refs_owner_idx ON blobstore.refs (owner_kind, owner_id);

-- Attachments: a handle (display name made unique) per conversation.
CREATE TABLE blobstore.attachments (
    conversation_id  text NOT NULL,
    handle           text NOT NULL,
    display_name     text NOT NULL,
    sha256           text NOT NULL REFERENCES blobstore.blobs (sha256),
    media_type       text NOT NULL,
    size             bigint NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (conversation_id, handle)
);
