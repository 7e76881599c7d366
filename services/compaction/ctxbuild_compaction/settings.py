"""Compaction service settings (`CTX_` env prefix). NATS is its only direct dependency; persistence, the blob
store and (for the ``llm`` summarizer) an LLM endpoint are reached through it / the provider adapters."""

from __future__ import annotations

from typing import Literal

from ctxbuild_platform.settings import ServiceSettings
from pydantic import Field, SecretStr


class Settings(ServiceSettings):
    service_name: str = "compaction"
    history_timeout_s: float = Field(15.0, description="timeout of ctx.persist.history")
    append_timeout_s: float = Field(10.0, description="timeout of ctx.persist.append (storing a summary)")
    blob_put_timeout_s: float = Field(5.0, description="masking: a blob put slower than this keeps the output")
    summarizer: Literal["extractive", "llm", "masking"] = Field(
        "extractive", description="default summarizer; a request's settings.summarizer overrides it")
    summarizer_provider: Literal["openai", "anthropic"] | None = Field(
        None, description="llm summarizer endpoint kind; unset = the turn's provider kind")
    summarizer_model: str | None = Field(None, description="llm summarizer model; unset = compress.modelId, "
                                                           "else the turn's own model")
    summarizer_window: int | None = Field(None, description="the summarizer model's context window, if known")
    summarizer_timeout_s: float = Field(90.0, description="one summarizer model call")
    openai_base_url: str | None = Field(None, description="OpenAI-compatible endpoint for the llm summarizer")
    openai_api_key: SecretStr | None = Field(None, description="never defaulted")
    anthropic_base_url: str | None = None
    anthropic_api_key: SecretStr | None = Field(None, description="never defaulted")
