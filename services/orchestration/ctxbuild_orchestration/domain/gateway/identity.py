"""Implicit conversation identity (SPEC §15.5): chat clients resend the whole conversation on every request, so
a hash chain over the messages as the client sends them names each prefix. A request whose chain shares its
first k hashes with a stored conversation continues it after message k; an edited earlier message changes the
chain from there on, so the request matches only the shorter prefix and forks a branch.

The chain is dialect-independent: it hashes the neutral messages in a canonical spelling (adjacent text parts
joined, empty ones dropped, tool inputs as sorted-key JSON, server-only fields left out), so the same
conversation sent as OpenAI Chat Completions or as Anthropic Messages hashes the same. The tenant seeds the
chain: equal conversations of two tenants never share a hash."""

from __future__ import annotations

import hashlib
from typing import Any

from .types import GatewayRequest, canonical_json

_VERSION = "ctxbuild-gateway-prefix-v1"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _canonical_part(part: dict) -> dict[str, Any]:
    kind = part.get("type")
    if kind == "tool-call":
        return {"type": kind, "toolCallId": part.get("toolCallId"), "toolName": part.get("toolName"),
                "input": part.get("input")}
    if kind == "tool-result":
        return {"type": kind, "toolCallId": part.get("toolCallId"), "toolName": part.get("toolName"),
                "output": part.get("output")}
    return dict(part)


def canonical_message(message: dict) -> str:
    """The spelling of one neutral message the chain hashes."""
    parts: list[dict] = []
    for part in message.get("parts") or []:
        if part.get("type") == "text":
            if not part.get("text"):
                continue
            if parts and parts[-1].get("type") == "text":
                parts[-1] = {"type": "text", "text": parts[-1]["text"] + part["text"]}
                continue
        parts.append(_canonical_part(part))
    return canonical_json({"role": message.get("role"), "parts": parts})


def root_hash(tenant: str, system: str | None) -> str:
    """The chain's seed: the tenant and the client's system prompt."""
    return _sha(canonical_json([_VERSION, tenant, system or ""]))


def chain_hash(previous: str, message: dict) -> str:
    """The hash of a prefix one message longer than the one ``previous`` names."""
    return _sha(previous + "\n" + canonical_message(message))


def prefix_hashes(tenant: str, request: GatewayRequest) -> list[str]:
    """One hash per message: ``result[i]`` names ``request.messages[: i + 1]`` (under this tenant and system
    prompt), so ``len(result) == len(request.messages)``. The seed (root_hash) itself is not in the list."""
    hashes: list[str] = []
    current = root_hash(tenant, request.system)
    for message in request.messages:
        current = chain_hash(current, message)
        hashes.append(current)
    return hashes


__all__ = ["canonical_message", "chain_hash", "prefix_hashes", "root_hash"]
