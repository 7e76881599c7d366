"""Blob store service: content-addressed blobs in S3, metadata and references in Postgres, fs_read/read_file"""
