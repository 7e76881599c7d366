"""The provider interface the turn runner talks to, and byte-stable request rendering."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Protocol


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

    def render(self) -> bytes:
        # insertion-ordered, compact, no ASCII escaping: the same history always gives the same bytes
        doc = {"model": self.model, "system": self.system, "tools": [t.as_dict() for t in self.tools],
               "messages": self.messages}
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()

    def digest(self) -> str:
        return hashlib.sha256(self.render()).hexdigest()


@dataclass
class ModelResponse:
    """The assistant's parts (text and/or tool-call parts, SPEC §1) and provider-reported usage."""

    parts: list[dict[str, Any]]
    usage: dict[str, int]
    stop_reason: str  # "tool_calls" | "stop"

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return [p for p in self.parts if p["type"] == "tool-call"]


class ProviderError(Exception):
    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class Provider(Protocol):
    name: str

    async def complete(self, request: ModelRequest) -> ModelResponse: ...
