DROP TABLE IF EXISTS blobstore.attachments;
DROP TABLE IF EXISTS blobstore.refs;
DROP TABLE IF EXISTS blobstore.blobs;
