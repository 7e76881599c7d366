"""Compaction service settings (`CTX_` env prefix). Stateless today: NATS is its only dependency."""

from __future__ import annotations

from ctxbuild_platform.settings import ServiceSettings
from pydantic import Field


class Settings(ServiceSettings):
    service_name: str = "compaction"
    history_timeout_s: float = Field(15.0, description="timeout of ctx.persist.history")
