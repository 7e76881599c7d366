DROP INDEX IF EXISTS blobstore.attachments_sha_idx;
DROP INDEX IF EXISTS blobstore.refs_sha_conversation_idx;
DROP TABLE IF EXISTS blobstore.blob_index;
DROP INDEX IF EXISTS blobstore.blobs_unreferenced_idx;
ALTER TABLE blobstore.blobs DROP COLUMN IF EXISTS unreferenced_since, DROP COLUMN IF EXISTS is_text,
    DROP COLUMN IF EXISTS lines;
