"""Anthropic Messages over the official `anthropic` SDK, with prompt-cache breakpoints.

Breakpoints are placed on the request as rendered *after* truncation, where the bytes are final: the last tool
definition (tools + system are the stable head), the system prompt, and the newest message's last block (so the
next step's request — the same prefix plus new messages — reads everything before it from the cache).
Anthropic allows at most 4 breakpoints; this uses 3.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic

from .base import ModelRequest, ModelResponse, ProviderError
from .openai_chat import output_text

EPHEMERAL = {"type": "ephemeral"}


def to_wire_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ctxbuild messages → Anthropic turns (tool results travel in a user turn; same-role turns merge)."""
    wire: list[dict[str, Any]] = []
    for m in messages:
        blocks: list[dict[str, Any]] = []
        for p in m["parts"]:
            if p["type"] == "text" and p["text"]:
                blocks.append({"type": "text", "text": p["text"]})
            elif p["type"] == "file":
                blocks.append({"type": "text", "text": f"[attached file: {p['displayName']} "
                                                        f"(read_file handle: {p['handle']})]"})
            elif p["type"] == "tool-call":
                blocks.append({"type": "tool_use", "id": p["toolCallId"], "name": p["toolName"],
                               "input": p["input"]})
            elif p["type"] == "tool-result":
                block = {"type": "tool_result", "tool_use_id": p["toolCallId"],
                         "content": output_text(p["output"])}
                if p["output"].get("type", "").startswith("error-"):
                    block["is_error"] = True
                blocks.append(block)
        if not blocks:
            continue
        role = "assistant" if m["role"] == "assistant" else "user"
        if wire and wire[-1]["role"] == role:
            wire[-1]["content"].extend(blocks)
        else:
            wire.append({"role": role, "content": blocks})
    return wire


def build_params(request: ModelRequest, max_tokens: int) -> dict[str, Any]:
    messages = to_wire_messages(request.messages)
    if messages:
        messages[-1]["content"][-1] = {**messages[-1]["content"][-1], "cache_control": EPHEMERAL}
    params: dict[str, Any] = {"model": request.model, "max_tokens": request.max_output_tokens or max_tokens,
                              "messages": messages}
    if request.system:
        params["system"] = [{"type": "text", "text": request.system, "cache_control": EPHEMERAL}]
    if request.tools:
        tools = [{"name": t.name, "description": t.description, "input_schema": t.input_schema}
                 for t in request.tools]
        tools[-1]["cache_control"] = EPHEMERAL
        params["tools"] = tools
    return params


def from_wire(message: Any) -> ModelResponse:
    parts: list[dict[str, Any]] = []
    for block in message.content:
        if block.type == "text" and block.text:
            parts.append({"type": "text", "text": block.text})
        elif block.type == "tool_use":
            parts.append({"type": "tool-call", "toolCallId": block.id, "toolName": block.name,
                          "input": block.input if isinstance(block.input, dict) else json.loads(block.input)})
    u = message.usage
    usage = {"inputTokens": u.input_tokens, "outputTokens": u.output_tokens}
    if getattr(u, "cache_read_input_tokens", None):
        usage["cacheReadTokens"] = u.cache_read_input_tokens
    if getattr(u, "cache_creation_input_tokens", None):
        usage["cacheWriteTokens"] = u.cache_creation_input_tokens
    return ModelResponse(parts=parts, usage=usage,
                         stop_reason="tool_calls" if message.stop_reason == "tool_use" else "stop")


class AnthropicMessagesProvider:
    name = "anthropic"

    def __init__(self, model: str, *, api_key: str | None, base_url: str | None = None,
                 max_tokens: int = 4096, timeout_s: float = 120.0, max_retries: int = 2) -> None:
        self.client = anthropic.AsyncAnthropic(api_key=api_key or "EMPTY", base_url=base_url, timeout=timeout_s,
                                               max_retries=max_retries)
        self.model = model
        self.max_tokens = max_tokens

    async def complete(self, request: ModelRequest) -> ModelResponse:
        params = build_params(request, self.max_tokens)
        params["model"] = self.model
        try:
            message = await self.client.messages.create(**params)
        except anthropic.APIStatusError as exc:
            raise ProviderError(f"{self.model}: HTTP {exc.status_code}: {exc.message}",
                                retryable=exc.status_code in (429, 529) or exc.status_code >= 500) from exc
        except anthropic.APIConnectionError as exc:
            raise ProviderError(f"{self.model}: {exc}", retryable=True) from exc
        return from_wire(message)
