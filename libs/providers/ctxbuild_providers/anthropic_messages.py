"""Anthropic Messages over the official `anthropic` SDK, with prompt-cache breakpoints, streamed by default.

Breakpoints are placed on the request as rendered *after* truncation, where the bytes are final: the last tool
definition (tools + system are the stable head), the system prompt, and the newest message's last block (so the
next step's request — the same prefix plus new messages — reads everything before it from the cache).
Anthropic allows at most 4 breakpoints; this uses 3.

Usage: Anthropic's ``input_tokens`` counts only the uncached tail of the prompt, so inputTokens here is
``input_tokens + cache_read_input_tokens + cache_creation_input_tokens`` — the whole prompt, as OpenAI's
``prompt_tokens`` is (compaction trusts inputTokens as the size of the served context). The cache counts are
reported alongside as cacheReadTokens / cacheWriteTokens.
"""

from __future__ import annotations

from typing import Any

import anthropic

from .base import (
    WHOLE_ANSWER_TIMEOUT_S,
    ModelRequest,
    ModelResponse,
    ProviderError,
    TextCallback,
    tool_input,
    usage_dict,
)
from .openai_chat import output_text

try:  # the SDK's own HTTP package: a connection lost mid-stream surfaces as its error, not an SDK one
    import httpx2 as _http
except ImportError:  # pragma: no cover - anthropic<2 used httpx
    import httpx as _http  # type: ignore[no-redef]

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


def wire_tool_choice(choice: dict[str, Any] | None, parallel: bool | None) -> dict[str, Any] | None:
    """Neutral tool choice → Anthropic's (``required`` is ``any``); no parallel calls rides on it."""
    if choice is None and parallel is not False:
        return None
    kind = (choice or {"type": "auto"})["type"]
    out: dict[str, Any] = {"type": "any" if kind == "required" else kind}
    if kind == "tool":
        out["name"] = choice["name"]  # type: ignore[index]
    if parallel is False and kind != "none":
        out["disable_parallel_tool_use"] = True
    return out


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
        if (choice := wire_tool_choice(request.tool_choice, request.parallel_tool_calls)) is not None:
            params["tool_choice"] = choice
    if extra := {k: v for k, v in request.options.items() if k not in params}:
        params["extra_body"] = extra  # merged into the JSON body (the SDK names only some of them)
    return params


def wire_usage(u: Any) -> dict[str, int]:
    read = getattr(u, "cache_read_input_tokens", None)
    write = getattr(u, "cache_creation_input_tokens", None)
    prompt = (u.input_tokens or 0) + (read or 0) + (write or 0)
    return usage_dict(prompt, u.output_tokens, cache_read=read, cache_write=write)


def _stop(stop_reason: str | None, parts: list[dict[str, Any]]) -> str:
    return "tool_calls" if stop_reason == "tool_use" or any(p["type"] == "tool-call" for p in parts) else "stop"


def from_wire(message: Any, model: str = "model") -> ModelResponse:
    """A non-streamed Message → ModelResponse."""
    parts: list[dict[str, Any]] = []
    for block in message.content:
        if block.type == "text" and block.text:
            parts.append({"type": "text", "text": block.text})
        elif block.type == "tool_use":
            parts.append({"type": "tool-call", "toolCallId": block.id, "toolName": block.name,
                          "input": tool_input(model, block.name, block.input)})
    return ModelResponse(parts=parts, usage=wire_usage(message.usage), stop_reason=_stop(message.stop_reason, parts))


class MessageStream:
    """Assembles the raw stream events (message_start, content_block_start/delta/stop, message_delta,
    message_stop) into the ModelResponse the non-streamed call would give. A tool_use block's input arrives as
    ``input_json_delta`` fragments and is parsed once, at the end; usage starts in message_start and
    message_delta's cumulative counts override it."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.blocks: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, Any] = {}
        self.stop_reason: str | None = None
        self.stopped = False

    def feed(self, event: Any) -> str | None:
        """Take one event; return its text delta, if any."""
        kind = event.type
        if kind == "message_start":
            self.usage.update(event.message.usage.model_dump(exclude_none=True))
        elif kind == "content_block_start":
            block = event.content_block
            if block.type == "text":
                self.blocks[event.index] = {"type": "text", "text": [block.text] if block.text else []}
            elif block.type == "tool_use":
                self.blocks[event.index] = {"type": "tool_use", "id": block.id, "name": block.name,
                                            "input": block.input, "json": []}
        elif kind == "content_block_delta":
            block, delta = self.blocks.get(event.index), event.delta
            if block is None:
                return None  # a block kind we do not keep (thinking, server tools)
            if delta.type == "text_delta" and block["type"] == "text":
                block["text"].append(delta.text)
                return delta.text or None
            if delta.type == "input_json_delta" and block["type"] == "tool_use":
                block["json"].append(delta.partial_json)
        elif kind == "message_delta":
            self.stop_reason = event.delta.stop_reason or self.stop_reason
            if event.usage is not None:
                self.usage.update(event.usage.model_dump(exclude_none=True))
        elif kind == "message_stop":
            self.stopped = True
        return None

    def result(self) -> ModelResponse:
        if not self.stopped:
            raise ProviderError(f"{self.model}: the stream ended before message_stop", retryable=True)
        parts: list[dict[str, Any]] = []
        for index in sorted(self.blocks):
            b = self.blocks[index]
            if b["type"] == "text":
                if text := "".join(b["text"]):
                    parts.append({"type": "text", "text": text})
            else:
                raw = "".join(b["json"])
                parts.append({"type": "tool-call", "toolCallId": b["id"], "toolName": b["name"],
                              "input": tool_input(self.model, b["name"], raw if raw else b["input"] or {})})
        u = self.usage
        read, write = u.get("cache_read_input_tokens"), u.get("cache_creation_input_tokens")
        usage = usage_dict((u.get("input_tokens") or 0) + (read or 0) + (write or 0), u.get("output_tokens"),
                           cache_read=read, cache_write=write)
        return ModelResponse(parts=parts, usage=usage, stop_reason=_stop(self.stop_reason, parts))


_RETRYABLE_ERROR_TYPES = {"overloaded_error", "api_error", "rate_limit_error", "timeout_error"}


def map_error(model: str, exc: Exception) -> ProviderError:
    """SDK errors → ProviderError; retryable for 408/429/5xx/529, network failures, and transient error events
    sent mid-stream (those arrive on a 200 response, so the error type decides)."""
    if isinstance(exc, anthropic.APIStatusError):
        status = exc.status_code
        body = exc.body if isinstance(exc.body, dict) else {}
        err_type = (body.get("error") or {}).get("type") if isinstance(body.get("error"), dict) else None
        if status < 400:  # an `event: error` inside a stream that had started fine
            return ProviderError(f"{model}: error in the stream: {err_type or exc.message}",
                                 retryable=err_type in _RETRYABLE_ERROR_TYPES)
        return ProviderError(f"{model}: HTTP {status}: {exc.message}", status=status,
                             retryable=status in (408, 429) or status >= 500)
    if isinstance(exc, anthropic.APIConnectionError | _http.TransportError):  # includes timeouts
        return ProviderError(f"{model}: {type(exc).__name__}: {exc}", retryable=True)
    return ProviderError(f"{model}: {type(exc).__name__}: {exc}")


def anthropic_client(*, api_key: str | None, base_url: str | None = None, timeout_s: float = 120.0,
                     max_retries: int = 2) -> anthropic.AsyncAnthropic:
    """An SDK client for an Anthropic Messages endpoint; built once per process and endpoint (an SSL context and
    a connection pool), shared by the providers of every turn."""
    return anthropic.AsyncAnthropic(api_key=api_key or "EMPTY", base_url=base_url, timeout=timeout_s,
                                    max_retries=max_retries)


class AnthropicMessagesProvider:
    name = "anthropic"

    def __init__(self, model: str, *, api_key: str | None, base_url: str | None = None,
                 max_tokens: int = 4096, timeout_s: float = 120.0, max_retries: int = 2, stream: bool = True,
                 client: anthropic.AsyncAnthropic | None = None,
                 whole_answer_timeout_s: float = WHOLE_ANSWER_TIMEOUT_S) -> None:
        # the SDK retries 408/409/429/5xx and connection errors itself (max_retries) before a stream begins;
        # ``client``: a shared one (see ``anthropic_client``)
        self.client = client or anthropic_client(api_key=api_key, base_url=base_url, timeout_s=timeout_s,
                                                 max_retries=max_retries)
        self.model = model
        self.max_tokens = max_tokens
        self.stream = stream
        self.whole_answer_timeout_s = whole_answer_timeout_s

    async def complete(self, request: ModelRequest, *, on_text: TextCallback | None = None) -> ModelResponse:
        params = build_params(request, self.max_tokens)
        params["model"] = self.model
        try:
            if not self.stream:
                response = from_wire(await self.client.messages.create(**params, timeout=self.whole_answer_timeout_s),
                                     self.model)
                text = "".join(p["text"] for p in response.parts if p["type"] == "text")
                if on_text is not None and text:
                    await on_text(text)
                return response
            assembler = MessageStream(self.model)
            async with await self.client.messages.create(**params, stream=True) as events:
                async for event in events:
                    delta = assembler.feed(event)
                    if delta and on_text is not None:
                        await on_text(delta)
            return assembler.result()
        except (anthropic.AnthropicError, _http.TransportError) as exc:
            raise map_error(self.model, exc) from exc
