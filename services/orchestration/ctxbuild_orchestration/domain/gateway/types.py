"""The neutral form between the gateway's two wire formats and the runtime (SPEC §15.5): a request parsed from
either dialect, the turn's result to encode back, and the one error a parser raises. Messages are the runtime's
own parts (contracts/model/part.json) without ids: the server assigns those when it stores them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

Dialect = Literal["openai", "anthropic"]
StopReason = Literal["stop", "tool_calls", "length"]


@dataclass(frozen=True)
class ClientTool:
    """A tool the client declared: the client runs it, ctxbuild only offers it upstream and relays calls."""

    name: str
    description: str
    input_schema: dict


@dataclass
class GatewayRequest:
    dialect: Dialect
    model: str
    system: str | None
    messages: list[dict]
    tools: list[ClientTool] = field(default_factory=list)
    tool_choice: dict | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    conversation_id: str | None = None
    # the dialect's own remaining sampling fields (temperature, top_p, stop / stop_sequences, …), unchanged
    options: dict = field(default_factory=dict)


@dataclass
class GatewayResult:
    text: str
    tool_calls: list[dict]  # the client's own tools only: {"toolCallId", "toolName", "input"}
    stop_reason: StopReason
    # summed over the turn's steps; inputTokens is the whole prompt (cache reads/writes included), as the
    # runtime's providers report it
    usage: dict


class DialectError(Exception):
    """A request the dialect refuses, with the status and error type that dialect's own API would answer."""

    def __init__(self, status: int, type: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.message = message
        self.param = param


def invalid(message: str, param: str | None = None) -> DialectError:
    return DialectError(400, "invalid_request_error", message, param)


def canonical_json(value: Any) -> str:
    """One spelling per value: sorted keys, no spaces, unicode kept (tool inputs, hashes)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def effective_stop(result: GatewayResult) -> StopReason:
    """Calls handed to the client always end the turn as a tool-call stop, whatever the last step said."""
    if result.tool_calls and result.stop_reason == "stop":
        return "tool_calls"
    return result.stop_reason


def usage_counts(usage: dict) -> tuple[int, int, int, int]:
    """(whole prompt, output, cache read, cache write) as non-negative ints, missing counts as 0."""
    def n(key: str) -> int:
        try:
            return max(int(usage.get(key) or 0), 0)
        except (TypeError, ValueError):
            return 0
    return n("inputTokens"), n("outputTokens"), n("cacheReadTokens"), n("cacheWriteTokens")


def tool_input_json(value: Any) -> str:
    """A call's input as the JSON text both wire formats carry (a string kept verbatim: see parse_openai)."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def result_message(result: GatewayResult) -> dict:
    """The assistant message a client sends back for ``result`` on its next request, in neutral form — what
    the server hashes for a produced message so the follow-up request finds it (identity.chain_hash)."""
    parts: list[dict] = []
    if result.text:
        parts.append({"type": "text", "text": result.text})
    parts.extend({"type": "tool-call", "toolCallId": c["toolCallId"], "toolName": c["toolName"],
                  "input": c.get("input", {})} for c in result.tool_calls)
    return {"role": "assistant", "parts": parts}


def sse_comment(text: str) -> bytes:
    """An SSE comment frame (``: text``): every SSE parser skips it, so it can keep a quiet stream alive or
    carry a trailing note (e.g. ctxbuild's overhead) in either dialect without breaking a client."""
    lines = text.replace("\r", "").split("\n")
    return ("".join(f": {line}\n" for line in lines) + "\n").encode()
