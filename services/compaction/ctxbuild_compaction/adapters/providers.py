"""The ``llm`` summarizer's model, through the shared provider adapters (``ctxbuild_providers``)."""

from __future__ import annotations

from ctxbuild_providers import AnthropicMessagesProvider, OpenAIChatProvider, Provider

from ..settings import Settings


def make_provider(kind: str | None, model: str, settings: Settings) -> Provider | None:
    """An adapter for ``kind`` (openai | anthropic) when that endpoint is configured; None otherwise (the llm
    summarizer is then unavailable and the offline default is used)."""
    if kind == "openai" and (settings.openai_base_url or settings.openai_api_key):
        key = settings.openai_api_key.get_secret_value() if settings.openai_api_key else None
        return OpenAIChatProvider(model, base_url=settings.openai_base_url, api_key=key,
                                  timeout_s=settings.summarizer_timeout_s, max_retries=1)
    if kind == "anthropic" and (settings.anthropic_base_url or settings.anthropic_api_key):
        key = settings.anthropic_api_key.get_secret_value() if settings.anthropic_api_key else None
        return AnthropicMessagesProvider(model, api_key=key, base_url=settings.anthropic_base_url,
                                         timeout_s=settings.summarizer_timeout_s, max_retries=1)
    return None
