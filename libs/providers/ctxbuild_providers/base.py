"""The provider interface the turn runner talks to, and byte-stable request rendering."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

# receives the model's text as it streams (one call per delta; a non-streaming call gives one delta)
TextCallback = Callable[[str], Awaitable[None]]
# a call that is not streamed: how long its response may take (the SDKs' own default). Nothing arrives before the
# whole answer is written, so the client's timeout (between chunks of a stream) would cap the answer's length
WHOLE_ANSWER_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    input_schema: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "inputSchema": self.input_schema}


@dataclass
class ModelRequest:
    """What the model sees on one step: exactly these bytes are hashed and recorded (StepServed)."""

    model: str
    system: str
    messages: list[dict[str, Any]]
    tools: list[ToolSpec] = field(default_factory=list)
    max_output_tokens: int | None = None
    # a gateway client's choices (SPEC §15.5), sent upstream as given: neutral tool choice ({"type": "auto" |
    # "none" | "required"} or {"type": "tool", "name": …}), parallel tool calls, and sampling options already in
    # the upstream dialect's own terms (temperature, top_p, stop / stop_sequences, …)
    tool_choice: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def render(self) -> bytes:
        # insertion-ordered, compact, no ASCII escaping: the same history always gives the same bytes
        doc: dict[str, Any] = {"model": self.model, "system": self.system,
                               "tools": [t.as_dict() for t in self.tools], "messages": self.messages}
        # only when set, so a request without them keeps the bytes (and hash) it always had
        if self.tool_choice is not None:
            doc["toolChoice"] = self.tool_choice
        if self.parallel_tool_calls is not None:
            doc["parallelToolCalls"] = self.parallel_tool_calls
        if self.options:
            doc["options"] = self.options
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()

    def digest(self) -> str:
        return hashlib.sha256(self.render()).hexdigest()


@dataclass
class ModelResponse:
    """The assistant's parts (text and/or tool-call parts, SPEC §1) and provider-reported usage
    (``inputTokens``, ``outputTokens`` and, when the provider reports them, ``cacheReadTokens`` /
    ``cacheWriteTokens`` — integers, contracts/model/usage.json)."""

    parts: list[dict[str, Any]]
    usage: dict[str, int]
    stop_reason: str  # "tool_calls" | "stop"

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return [p for p in self.parts if p["type"] == "tool-call"]


class ProviderError(Exception):
    """A model call that failed; ``retryable`` when the same request may succeed later (429, 5xx, network)."""

    def __init__(self, message: str, *, retryable: bool = False, status: int | None = None) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.status = status


class Provider(Protocol):
    name: str

    async def complete(self, request: ModelRequest, *, on_text: TextCallback | None = None) -> ModelResponse: ...


def tool_input(model: str, tool_name: str, arguments: str | dict[str, Any] | None) -> dict[str, Any]:
    """A tool call's arguments as the JSON object the tool receives; anything else is the model's fault and a
    typed error (not a crash, and not a call with made-up input)."""
    if isinstance(arguments, dict):
        return arguments
    if arguments is None or not arguments.strip():
        return {}  # a no-argument call: some servers send "" instead of "{}"
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise ProviderError(f"{model}: the model's call to {tool_name} has invalid JSON arguments ({exc.msg} at "
                            f"char {exc.pos}): {arguments[:200]!r}") from exc
    if not isinstance(value, dict):
        raise ProviderError(f"{model}: the model's call to {tool_name} has arguments that are not a JSON object: "
                            f"{arguments[:200]!r}")
    return value


def usage_dict(input_tokens: Any, output_tokens: Any, cache_read: Any = None,
               cache_write: Any = None) -> dict[str, int]:
    """Usage with integer values only; cache counts only when the provider reported them (0 included)."""
    usage = {"inputTokens": int(input_tokens or 0), "outputTokens": int(output_tokens or 0)}
    if cache_read is not None:
        usage["cacheReadTokens"] = int(cache_read)
    if cache_write is not None:
        usage["cacheWriteTokens"] = int(cache_write)
    return usage
