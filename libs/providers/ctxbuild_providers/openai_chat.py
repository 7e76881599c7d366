"""OpenAI-compatible chat completions over the official `openai` SDK (OpenAI, vLLM, Ollama, Gemini's
compatible endpoint, aggregators): ctxbuild's parts ⇄ the chat wire format, streamed by default.

Usage: ``prompt_tokens`` → inputTokens (it already includes cached tokens), ``completion_tokens`` →
outputTokens, ``prompt_tokens_details.cached_tokens`` → cacheReadTokens when the server reports it.

The call goes through the SDK's documented generic verb (``client.post``, the README's "undocumented endpoints"):
the client's retries, timeouts, auth, status errors, SSE decoding and mid-stream error events as
``chat.completions.create`` has them, without the two steps that are pure overhead here — walking our params
against the SDK's TypedDicts (nothing in them is aliased or reformatted; we build the wire shape ourselves) and
building a pydantic model per streamed chunk that we read once (``cast_to=object``: the decoded JSON as is).
"""

from __future__ import annotations

import json
from typing import Any

import openai

from .base import (
    WHOLE_ANSWER_TIMEOUT_S,
    ModelRequest,
    ModelResponse,
    ProviderError,
    TextCallback,
    tool_input,
    usage_dict,
)


def output_text(output: dict[str, Any]) -> str:
    """The text a tool output shows the model (SPEC §4 opaque extraction)."""
    kind, value = output.get("type"), output.get("value")
    if kind in ("text", "error-text"):
        return value
    if kind in ("json", "error-json"):
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if kind == "content":
        return "\n".join(b["text"] for b in value if b.get("type") == "text" and b.get("text"))
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def to_wire_messages(system: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    wire: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for m in messages:
        texts = [p["text"] for p in m["parts"] if p["type"] == "text"]
        if m["role"] in ("user", "system"):
            files = [f"[attached file: {p['displayName']} (read_file handle: {p['handle']})]"
                     for p in m["parts"] if p["type"] == "file"]
            wire.append({"role": m["role"], "content": "\n\n".join(texts + files)})
        elif m["role"] == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "\n\n".join(texts) or None}
            calls = [{"id": p["toolCallId"], "type": "function",
                      "function": {"name": p["toolName"],
                                   "arguments": json.dumps(p["input"], ensure_ascii=False, separators=(",", ":"))}}
                     for p in m["parts"] if p["type"] == "tool-call"]
            if calls:
                msg["tool_calls"] = calls
            wire.append(msg)
        elif m["role"] == "tool":
            for p in m["parts"]:
                if p["type"] == "tool-result":
                    wire.append({"role": "tool", "tool_call_id": p["toolCallId"], "content": output_text(p["output"])})
    return wire


def wire_tool_choice(choice: dict[str, Any]) -> str | dict[str, Any]:
    if choice.get("type") == "tool":
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice["type"]


def to_wire_tools(request: ModelRequest) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.input_schema}} for t in request.tools]


def _obj(value: Any) -> dict[str, Any]:
    """A wire object, or an empty one where the server sent null (or something else)."""
    return value if isinstance(value, dict) else {}


def wire_usage(u: dict[str, Any] | None) -> dict[str, int]:
    if not isinstance(u, dict):  # a server that does not meter (or ignored stream_options)
        return usage_dict(0, 0)
    cached = _obj(u.get("prompt_tokens_details")).get("cached_tokens")
    return usage_dict(u.get("prompt_tokens") or 0, u.get("completion_tokens") or 0, cache_read=cached)


def _response(model: str, text: str, calls: list[tuple[str, str, Any]], usage: dict[str, int]) -> ModelResponse:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    for call_id, name, arguments in calls:
        parts.append({"type": "tool-call", "toolCallId": call_id, "toolName": name,
                      "input": tool_input(model, name, arguments)})
    return ModelResponse(parts=parts, usage=usage, stop_reason="tool_calls" if calls else "stop")


def from_wire(completion: Any, model: str = "model") -> ModelResponse:
    """A non-streamed chat completion (its JSON) → ModelResponse."""
    choices = _obj(completion).get("choices")
    if not choices or not isinstance(choices, list):
        raise ProviderError(f"{model}: empty completion")
    msg = _obj(_obj(choices[0]).get("message"))
    calls = [(c.get("id"), _obj(c.get("function")).get("name"), _obj(c.get("function")).get("arguments"))
             for c in map(_obj, msg.get("tool_calls") or [])]
    return _response(model, msg.get("content") or "", calls, wire_usage(completion.get("usage")))


class ChatStream:
    """Assembles streamed chat completion chunks (their JSON) into the ModelResponse the non-streamed call would give.

    Tool calls arrive as fragments keyed by ``index``: the first carries id and name, later ones append to
    ``arguments`` (one chunk may hold several fragments of one index). The usage chunk comes last with no
    choices (``stream_options.include_usage``)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.text: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: Any = None

    def feed(self, chunk: Any) -> str | None:
        """Take one chunk; return its text delta, if any."""
        chunk = _obj(chunk)
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        delta_text: list[str] = []
        for choice in map(_obj, chunk.get("choices") or []):
            if choice.get("index", 0) != 0:
                continue
            delta = _obj(choice.get("delta"))
            if content := delta.get("content"):
                self.text.append(content)
                delta_text.append(content)
            for frag in map(_obj, delta.get("tool_calls") or []):
                call = self.calls.setdefault(frag.get("index", 0), {"id": "", "name": "", "arguments": []})
                if frag.get("id") and not call["id"]:
                    call["id"] = frag["id"]
                fn = _obj(frag.get("function"))
                # some compatible servers repeat the full name on every fragment
                if fn.get("name") and fn["name"] != call["name"]:
                    call["name"] += fn["name"]
                if fn.get("arguments"):
                    call["arguments"].append(fn["arguments"])
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return "".join(delta_text) or None

    def result(self) -> ModelResponse:
        if self.finish_reason is None:
            raise ProviderError(f"{self.model}: the stream ended before the model finished", retryable=True)
        calls = []
        for index in sorted(self.calls):
            call = self.calls[index]
            if not call["name"]:
                raise ProviderError(f"{self.model}: streamed tool call #{index} has no function name")
            calls.append((call["id"] or f"call_{index}", call["name"], "".join(call["arguments"])))
        return _response(self.model, "".join(self.text), calls, wire_usage(self.usage))


_RETRYABLE_STREAM_ERRORS = ("server_error", "rate_limit", "overloaded", "timeout", "unavailable", "internal")


def map_error(model: str, exc: openai.OpenAIError) -> ProviderError:
    """SDK errors → ProviderError; retryable for 408/429/5xx, network failures, and transient mid-stream
    error events (which carry no HTTP status: the response had already begun with 200)."""
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        return ProviderError(f"{model}: HTTP {status}: {exc.message}", status=status,
                             retryable=status in (408, 429) or status >= 500)
    if isinstance(exc, openai.APIConnectionError):  # includes APITimeoutError
        return ProviderError(f"{model}: {type(exc).__name__}: {exc}", retryable=True)
    if isinstance(exc, openai.APIError):
        body = exc.body if isinstance(exc.body, dict) else {}
        kind = f"{body.get('type') or ''} {body.get('code') or ''}".lower()
        return ProviderError(f"{model}: error in the stream: {exc.message}",
                             retryable=any(k in kind for k in _RETRYABLE_STREAM_ERRORS))
    return ProviderError(f"{model}: {type(exc).__name__}: {exc}")


def openai_client(*, base_url: str | None, api_key: str | None, timeout_s: float = 120.0,
                  max_retries: int = 2) -> openai.AsyncOpenAI:
    """An SDK client for an OpenAI-compatible endpoint. Building one costs an SSL context and a connection pool:
    a process that calls the same endpoint for many turns builds it once and hands it to each provider."""
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key or "EMPTY", timeout=timeout_s,
                              max_retries=max_retries)


_PATH = "/chat/completions"
# the auth chat.completions.create asks for (the client's API key as a bearer token)
_OPTIONS = openai.RequestOptions(security={"bearer_auth": True})
_CHUNKS = openai.AsyncStream[object]  # each SSE chunk as its decoded JSON


class OpenAIChatProvider:
    name = "openai"

    def __init__(self, model: str, *, base_url: str | None, api_key: str | None, timeout_s: float = 120.0,
                 max_retries: int = 2, stream: bool = True, client: openai.AsyncOpenAI | None = None,
                 whole_answer_timeout_s: float = WHOLE_ANSWER_TIMEOUT_S) -> None:
        # local servers (vLLM, Ollama) accept any key; the SDK insists on one. The SDK retries 408/409/429/5xx
        # and connection errors itself (max_retries) before the first byte of a stream. ``client``: a shared one
        # (see ``openai_client``) — its connection pool and TLS context outlive this provider.
        self.client = client or openai_client(base_url=base_url, api_key=api_key, timeout_s=timeout_s,
                                              max_retries=max_retries)
        self.model = model
        self.stream = stream
        self._whole = openai.RequestOptions(security={"bearer_auth": True}, timeout=whole_answer_timeout_s)

    def params(self, request: ModelRequest) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"model": self.model, "messages": to_wire_messages(request.system, request.messages)}
        if request.tools:
            kwargs["tools"] = to_wire_tools(request)
            if request.tool_choice is not None:
                kwargs["tool_choice"] = wire_tool_choice(request.tool_choice)
            if request.parallel_tool_calls is not None:
                kwargs["parallel_tool_calls"] = request.parallel_tool_calls
        if request.max_output_tokens:
            kwargs["max_tokens"] = request.max_output_tokens
        if self.stream:
            kwargs["stream"] = True
            kwargs["stream_options"] = {"include_usage": True}
        # the client's sampling options, in the body whatever the SDK version names (never over ours)
        kwargs.update((k, v) for k, v in request.options.items() if k not in kwargs)
        return kwargs

    async def complete(self, request: ModelRequest, *, on_text: TextCallback | None = None) -> ModelResponse:
        body = self.params(request)
        try:
            if not self.stream:
                completion = await self.client.post(_PATH, body=body, cast_to=object, options=self._whole)
                response = from_wire(completion, self.model)
                text = "".join(p["text"] for p in response.parts if p["type"] == "text")
                if on_text is not None and text:
                    await on_text(text)
                return response
            assembler = ChatStream(self.model)
            async with await self.client.post(_PATH, body=body, cast_to=object, options=_OPTIONS, stream=True,
                                              stream_cls=_CHUNKS) as chunks:
                async for chunk in chunks:
                    delta = assembler.feed(chunk)
                    if delta and on_text is not None:
                        await on_text(delta)
            return assembler.result()
        except openai.OpenAIError as exc:
            raise map_error(self.model, exc) from exc
