"""Truncation service settings (`CTX_` env prefix). It owns no state: NATS is its only dependency."""

from __future__ import annotations

from ctxbuild_platform.settings import ServiceSettings
from pydantic import Field


class Settings(ServiceSettings):
    service_name: str = "truncation"
    blob_put_timeout_s: float = Field(
        5.0, description="a blob put slower than this falls back to the inline excerpt (the turn goes on)")
