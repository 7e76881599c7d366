"""Blob store settings (CTX_ env prefix). Secrets have no defaults."""

from __future__ import annotations

from ctxbuild_platform.settings import ServiceSettings
from pydantic import AnyHttpUrl, Field, PostgresDsn, SecretStr


class Settings(ServiceSettings):
    service_name: str = "blobstore"
    database_url: PostgresDsn = Field(description="PostgreSQL URL (postgresql://…); the schema is `blobstore`")
    db_pool_min: int = Field(1, ge=0)
    db_pool_max: int = Field(10, ge=1)
    db_timeout_s: float = Field(5.0, gt=0, description="connect/command timeout for Postgres")

    s3_endpoint: AnyHttpUrl = Field(description="S3 endpoint, http(s)://host:port")
    s3_access_key: str = Field(description="S3 access key id")
    s3_secret_key: SecretStr = Field(description="S3 secret key")
    s3_bucket: str = "ctxbuild-blobs"
    s3_region: str = Field("us-east-1", description="set explicitly so the client never probes the location")
    s3_timeout_s: float = Field(3.0, gt=0, description="per S3 call; a dead S3 fails fast as `unavailable`")

    read_cap_chars: int = Field(50_000, ge=2_000,
                                description="fs_read page cap (= the truncate threshold); larger pages are refused")
    fs_read_max_bytes: int = Field(64 * 1024 * 1024, ge=1, description="blobs larger than this are `too-large`")
    cache_bytes: int = Field(32 * 1024 * 1024, ge=0,
                             description="in-process cache of blob texts (content-addressed, so never stale)")
