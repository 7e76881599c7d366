-- depends: 0001_blobstore_initial
-- Large blobs: the text facts and a sparse seek index computed while the bytes stream in, so a page of a
-- 100 MB blob is served from a small ranged read. GC: when a blob lost its last reference.

-- binary content (possible through the chunked upload) has no character count
ALTER TABLE blobstore.blobs ALTER COLUMN chars DROP NOT NULL;
ALTER TABLE blobstore.blobs
    ADD COLUMN lines bigint CHECK (lines >= 0),         -- fs_read lines (split on \n, trailing empty dropped)
    ADD COLUMN is_text boolean,                          -- NULL: not indexed yet (rows from 0001)
    ADD COLUMN unreferenced_since timestamptz;           -- set when the last reference is released

-- existing rows without any reference start their grace period now
UPDATE blobstore.blobs b SET unreferenced_since = now()
 WHERE NOT EXISTS (SELECT 1 FROM blobstore.refs r WHERE r.sha256 = b.sha256);
CREATE INDEX blobs_unreferenced_idx ON blobstore.blobs (unreferenced_since) WHERE unreferenced_since IS NOT NULL;

-- seek marks: line_nos[i] starts at byte line_offsets[i]; char_nos[i] starts at byte char_offsets[i]
CREATE TABLE blobstore.blob_index (
    sha256        text PRIMARY KEY REFERENCES blobstore.blobs (sha256) ON DELETE CASCADE,
    line_nos      bigint[] NOT NULL,
    line_offsets  bigint[] NOT NULL,
    char_nos      bigint[] NOT NULL,
    char_offsets  bigint[] NOT NULL,
    CHECK (cardinality(line_nos) = cardinality(line_offsets) AND cardinality(char_nos) = cardinality(char_offsets))
);

CREATE INDEX refs_sha_conversation_idx ON blobstore.refs (sha256, conversation_id);
CREATE INDEX attachments_sha_idx ON blobstore.attachments (conversation_id, sha256);
