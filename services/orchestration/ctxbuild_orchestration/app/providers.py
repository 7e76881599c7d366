"""The model behind a turn: the provider its command names, refused early when this deployment cannot reach it."""

from __future__ import annotations

import json
from typing import Any

from ctxbuild_platform.errors import ServiceError
from ctxbuild_providers import (
    AnthropicMessagesProvider,
    OpenAIChatProvider,
    Provider,
    ReplayProvider,
    anthropic_client,
    openai_client,
)

from ..adapters.backends import Backends
from ..settings import Settings


def check_provider(spec: dict[str, Any], settings: Settings) -> None:
    """Refuse at the edge a turn whose provider this deployment cannot reach (typed, 400)."""
    if spec["kind"] == "anthropic" and settings.anthropic_api_key is None and settings.anthropic_base_url is None:
        raise ServiceError("no Anthropic endpoint configured: set CTX_ANTHROPIC_API_KEY on the orchestration "
                           "service", code="provider-not-configured")
    if spec["kind"] == "openai" and settings.openai_api_key is None and settings.openai_base_url is None:
        raise ServiceError("no OpenAI-compatible endpoint configured: set CTX_OPENAI_BASE_URL and/or "
                           "CTX_OPENAI_API_KEY on the orchestration service", code="provider-not-configured")


def provider_factory(settings: Settings, backends: Backends):
    """Each turn gets its provider (the model its command names); the SDK client under it — an SSL context and a
    keep-alive connection pool to the deployment's one endpoint per kind — is built once, on first use, and shared:
    building it per turn cost more than the rest of a small turn's own work, and a fresh connection per turn
    added the TCP handshake to every model call."""
    clients: dict[str, Any] = {}

    def client(kind: str) -> Any:
        if kind not in clients:
            if kind == "anthropic":
                key = settings.anthropic_api_key.get_secret_value() if settings.anthropic_api_key else None
                clients[kind] = anthropic_client(api_key=key, base_url=settings.anthropic_base_url)
            else:
                key = settings.openai_api_key.get_secret_value() if settings.openai_api_key else None
                clients[kind] = openai_client(base_url=settings.openai_base_url, api_key=key)
        return clients[kind]

    async def make(spec: dict[str, Any], conversation_id: str, turn_id: str) -> Provider:
        check_provider(spec, settings)
        if spec["kind"] == "replay":
            if "scriptRef" in spec:  # claim check: a large recorded script lives in the blob store
                doc = json.loads(await backends.blobs.get_text(conversation_id, sha256=spec["scriptRef"]["sha256"]))
            else:
                doc = spec
            return ReplayProvider(doc["script"], tools=doc.get("tools") or None,
                                  call_id_prefix=f"call_{turn_id.rsplit('_', 1)[-1][-8:]}")
        # a gateway client that asked for one whole answer: the model is asked for one (no stream to decode)
        whole = {"stream": spec.get("stream", True), "whole_answer_timeout_s": settings.model_whole_answer_timeout_s}
        if spec["kind"] == "anthropic":
            return AnthropicMessagesProvider(spec["model"], api_key=None, client=client("anthropic"), **whole)
        return OpenAIChatProvider(spec["model"], base_url=None, api_key=None, client=client("openai"), **whole)

    return make
