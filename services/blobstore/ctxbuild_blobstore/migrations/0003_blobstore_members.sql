-- depends: 0002_blobstore_index_gc
-- A fold's transcript (SPEC §15.2) declares the archived outputs of the rows it folded as its members: while the
-- transcript is in a read's retained context, its members stay readable (folded rows are not revoked). Written
-- with the transcript's reference by the storing service; a read never trusts a caller's list.
CREATE TABLE blobstore.blob_members (
    conversation_id    text NOT NULL,
    transcript_sha256  text NOT NULL REFERENCES blobstore.blobs (sha256) ON DELETE CASCADE,
    transcript_prefix  text GENERATED ALWAYS AS (left(transcript_sha256, 16)) STORED,
    member_prefix      text NOT NULL CHECK (member_prefix ~ '^[0-9a-f]{16}$'),  -- the member's vfs_<16 hex> handle
    PRIMARY KEY (conversation_id, member_prefix, transcript_sha256)
);
CREATE INDEX blob_members_transcript_idx ON blobstore.blob_members (transcript_sha256);
