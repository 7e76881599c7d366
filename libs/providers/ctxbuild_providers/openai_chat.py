"""OpenAI-compatible chat completions over the official `openai` SDK (OpenAI, vLLM, Ollama, Gemini's
compatible endpoint, aggregators): ctxbuild's parts ⇄ the chat wire format."""

from __future__ import annotations

import json
from typing import Any

import openai

from .base import ModelRequest, ModelResponse, ProviderError


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


def to_wire_tools(request: ModelRequest) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.input_schema}} for t in request.tools]


def from_wire(completion: Any) -> ModelResponse:
    choice = completion.choices[0]
    msg = choice.message
    parts: list[dict[str, Any]] = []
    if msg.content:
        parts.append({"type": "text", "text": msg.content})
    for call in msg.tool_calls or []:
        try:
            args = json.loads(call.function.arguments or "{}")
        except json.JSONDecodeError:
            # the model produced invalid JSON: pass it through so the tool answers with a typed error
            args = {"_invalid_json_arguments": call.function.arguments}
        parts.append({"type": "tool-call", "toolCallId": call.id, "toolName": call.function.name, "input": args})
    u = completion.usage
    usage = {"inputTokens": u.prompt_tokens if u else 0, "outputTokens": u.completion_tokens if u else 0}
    cached = getattr(getattr(u, "prompt_tokens_details", None), "cached_tokens", None) if u else None
    if cached:
        usage["cacheReadTokens"] = cached
    return ModelResponse(parts=parts, usage=usage,
                         stop_reason="tool_calls" if msg.tool_calls else "stop")


class OpenAIChatProvider:
    name = "openai"

    def __init__(self, model: str, *, base_url: str | None, api_key: str | None, timeout_s: float = 120.0,
                 max_retries: int = 2) -> None:
        # local servers (vLLM, Ollama) accept any key; the SDK insists on one
        self.client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key or "EMPTY", timeout=timeout_s,
                                         max_retries=max_retries)
        self.model = model

    async def complete(self, request: ModelRequest) -> ModelResponse:
        kwargs: dict[str, Any] = {"model": self.model, "messages": to_wire_messages(request.system, request.messages)}
        if request.tools:
            kwargs["tools"] = to_wire_tools(request)
        if request.max_output_tokens:
            kwargs["max_tokens"] = request.max_output_tokens
        try:
            completion = await self.client.chat.completions.create(**kwargs)
        except openai.APIStatusError as exc:
            raise ProviderError(f"{self.model}: HTTP {exc.status_code}: {exc.message}",
                                retryable=exc.status_code == 429 or exc.status_code >= 500) from exc
        except openai.APIConnectionError as exc:
            raise ProviderError(f"{self.model}: {exc}", retryable=True) from exc
        if not completion.choices:
            raise ProviderError(f"{self.model}: empty completion")
        return from_wire(completion)
