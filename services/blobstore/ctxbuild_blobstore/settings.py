"""Blob store settings (CTX_ env prefix). Secrets have no defaults."""

from __future__ import annotations

from ctxbuild_platform.settings import ServiceSettings
from pydantic import AnyHttpUrl, Field, PostgresDsn, SecretStr

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB


class Settings(ServiceSettings):
    service_name: str = "blobstore"
    database_url: PostgresDsn = Field(description="PostgreSQL URL (postgresql://…); the schema is `blobstore`")
    db_pool_min: int = Field(1, ge=0)
    db_pool_max: int = Field(20, ge=2, description="a writer holds a connection (and the blob's lock) across its "
                                                   "S3 write")
    db_timeout_s: float = Field(5.0, gt=0, description="connect/command timeout for Postgres")

    s3_endpoint: AnyHttpUrl = Field(description="S3 endpoint, http(s)://host:port")
    s3_access_key: str = Field(description="S3 access key id")
    s3_secret_key: SecretStr = Field(description="S3 secret key")
    s3_bucket: str = "ctxbuild-blobs"
    s3_region: str = Field("us-east-1", description="set explicitly so the client never probes the location")
    s3_timeout_s: float = Field(3.0, gt=0, description="per S3 call; a dead S3 fails fast as `unavailable`")
    s3_slow_timeout_s: float = Field(120.0, gt=0, description="read timeout of calls that grow with the object "
                                                              "(multipart parts, complete, server-side copy)")

    read_cap_chars: int = Field(50_000, ge=2_000,
                                description="fs_read page cap (= the truncate threshold); larger pages are refused")
    fs_read_pattern_timeout_s: float = Field(2.0, gt=0, description="fs_read with a pattern: the regular "
                                             "expression's time bound for one read (a catastrophic pattern "
                                             "answers pattern-timeout)")
    fs_read_max_bytes: int = Field(4 * GIB, ge=1, description="blobs larger than this are `too-large` for "
                                                              "fs_read/read_file (pages are streamed: no memory "
                                                              "reason for a low limit)")
    cache_bytes: int = Field(32 * MIB, ge=0,
                             description="in-process cache of small objects' bytes (content-addressed, never stale)")
    cache_object_max_bytes: int = Field(1 * MIB, ge=0, description="objects up to this size are read whole and cached")

    # claim check (chunked transfer over NATS, see README)
    transfer_chunk_bytes: int = Field(512 * KIB, ge=4 * KIB, le=768 * KIB,
                                      description="default push chunk (get); pulls, and gets whose caller "
                                                  "offers maxChunk, use up to the connection's max_payload")
    transfer_window: int = Field(4, ge=1, le=32, description="chunks in flight per transfer")
    transfer_timeout_s: float = Field(10.0, gt=0, description="a caller's inbox must answer within this")
    upload_part_bytes: int = Field(8 * MIB, ge=5 * MIB, description="S3 multipart part size (S3 minimum: 5 MiB); "
                                                                   "smaller uploads are one PUT")
    upload_max_bytes: int = Field(2 * GIB, ge=1, le=5 * GIB, description="largest blob (`too-large` beyond)")
    max_uploads: int = Field(4, ge=1, description="concurrent chunked uploads per instance (memory: about "
                                                  "2 × part size each)")
    index_stride_bytes: int = Field(64 * KIB, ge=1 * KIB, description="seek-mark spacing of the text index")

    # garbage collection (SPEC §6)
    gc_grace_s: float = Field(3600.0, ge=0, description="a blob unreferenced (or an object without metadata) for "
                                                        "longer than this is deleted")
    gc_interval_s: float = Field(300.0, ge=0, description="time between collection rounds; 0 = no background GC")
    gc_batch: int = Field(500, ge=1, description="blobs examined per query")
    upload_stale_s: float = Field(3600.0, ge=0, description="unfinished multipart uploads and staging objects "
                                                            "older than this are removed")

    fault_exit_after_object_write: bool = Field(
        False, description="TEST HOOK: exit the process right after an object write, before its metadata "
                           "(simulates the crash SPEC §6 says must leave only a collectable orphan)")
