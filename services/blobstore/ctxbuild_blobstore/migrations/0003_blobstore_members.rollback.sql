DROP TABLE IF EXISTS blobstore.blob_members;
