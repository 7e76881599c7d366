"""The replay provider: plays back recorded/scripted model decisions, offline and deterministic.

A script is a list of steps; step *k* of a turn answers the *k*-th model call of that turn. A step is
``{"text": "…"}`` (final answer) or ``{"toolCalls": [{"toolName": …, "input": {…}}], "text"?: …}``.
Input strings may use ``{{last_offload_uri}}`` (the newest offloaded tool output the model has been shown) or
``{{offload_uri:K}}`` (the K-th, 1-based, in the order shown): the model can only cite what is in its context,
so the replay reads URIs from the request.

A tool name ``mcp:<server>/<tool>`` names an MCP tool without its hashed id; it resolves against the tools
offered in the request (``mcp__<server>__<tool>_<hash>``).

A tool-call entry may carry ``"output"``: the tool output recorded with the decision (SPEC §1 output union, e.g.
``{"type": "text", "value": "…"}``); :meth:`ReplayProvider.recorded_output` returns it for the call id the replay
produced (``call_<step>_<i>``, deterministic), so a trajectory replays with its own tool results. ``tools`` lists
the recorded tools the turn should offer (``{name, description, inputSchema}``).

Usage is reported as the shared tokenizer's count of the rendered request (a replay has no provider meter).
"""

from __future__ import annotations

import json
import re
from typing import Any

from ctxbuild_codec.tokens import count_messages, count_text

from .base import ModelRequest, ModelResponse, ProviderError, TextCallback, ToolSpec

_URI = re.compile(r"context://vfs/vfs_[0-9a-f]{16}\.txt")


_SLOT = re.compile(r"\{\{(last_offload_uri|offload_uri:(-?\d+))\}\}")


def offload_uris(messages: list[dict[str, Any]]) -> list[str]:
    """Archive URIs in the order the model was shown them (typed offload first, else marker text)."""
    uris: list[str] = []
    for m in messages:
        for p in m.get("parts", []):
            if p.get("type") != "tool-result":
                continue
            off = p.get("offload") or {}
            if off.get("uri"):
                uris.append(off["uri"])
                continue
            value = (p.get("output") or {}).get("value")
            if isinstance(value, str):
                uris.extend(_URI.findall(value))
    return uris


def last_offload_uri(messages: list[dict[str, Any]]) -> str | None:
    uris = offload_uris(messages)
    return uris[-1] if uris else None


def _substitute(value: Any, messages: list[dict[str, Any]]) -> Any:
    if isinstance(value, str) and "{{" in value:
        def fill(match: re.Match[str]) -> str:
            uris = offload_uris(messages)
            k = -1 if match.group(1) == "last_offload_uri" else int(match.group(2))
            idx = k if k < 0 else k - 1
            if not uris or not -len(uris) <= idx < len(uris):
                raise ProviderError(f"replay script asks for {match.group(0)}; {len(uris)} outputs archived")
            return uris[idx]

        return _SLOT.sub(fill, value)
    if isinstance(value, dict):
        return {k: _substitute(v, messages) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, messages) for v in value]
    return value


def _resolve_tool_name(name: str, offered: list[str]) -> str:
    if not name.startswith("mcp:"):
        return name
    server, _, tool = name[4:].partition("/")
    prefix = f"mcp__{server}__{tool}_"
    for candidate in offered:
        if candidate.startswith(prefix):
            return candidate
    raise ProviderError(f"replay script calls {name} but no offered tool matches {prefix}*")


OUTPUT_TYPES = ("text", "json", "error-text", "error-json", "content")
def _check_script(script: Any) -> None:
    """Bad scripts fail when the provider is built, naming the step, not halfway through a turn."""
    if not isinstance(script, list) or not script:
        raise ProviderError("empty replay script")
    for k, step in enumerate(script, 1):
        if not isinstance(step, dict) or not ("text" in step or "toolCalls" in step):
            raise ProviderError(f"replay step {k}: expected {{'text': …}} or {{'toolCalls': [...]}}")
        calls = step.get("toolCalls", [])
        if not isinstance(calls, list):
            raise ProviderError(f"replay step {k}: toolCalls must be a list")
        for i, call in enumerate(calls, 1):
            if not isinstance(call, dict) or not isinstance(call.get("toolName"), str) or not call["toolName"]:
                raise ProviderError(f"replay step {k} call {i}: toolName is required")
            if not isinstance(call.get("input", {}), dict):
                raise ProviderError(f"replay step {k} call {i}: input must be an object")
            out = call.get("output")
            if out is not None and not (isinstance(out, dict) and out.get("type") in OUTPUT_TYPES and "value" in out):
                raise ProviderError(f"replay step {k} call {i}: output must be {{type: {'|'.join(OUTPUT_TYPES)}, "
                                    f"value}}")


def _tool_spec(tool: Any) -> ToolSpec:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
        raise ProviderError(f"replay tool {tool!r}: name is required")
    schema = tool.get("inputSchema", {"type": "object"})
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise ProviderError(f"replay tool {tool['name']}: inputSchema must be an object schema")
    return ToolSpec(tool["name"], str(tool.get("description") or ""), schema)


class ReplayProvider:
    name = "replay"

    def __init__(self, script: list[dict[str, Any]], turn_key: str = "turn",
                 tools: list[dict[str, Any]] | None = None, call_id_prefix: str = "call") -> None:
        """``call_id_prefix``: call ids are ``<prefix>_<step>_<i>``; the runner makes the prefix unique per turn,
        as a real provider's ids are (a replayed conversation would otherwise repeat ``call_1_1`` every turn)."""
        _check_script(script)
        self.script = script
        self.turn_key = turn_key
        self._tools = [_tool_spec(t) for t in tools or []]
        self.call_id_prefix = call_id_prefix
        self._call_id = re.compile(re.escape(call_id_prefix) + r"_(\d+)_(\d+)")

    @property
    def recorded_tools(self) -> list[ToolSpec]:
        """The tools of the recorded run, to offer the model alongside the turn's own."""
        return list(self._tools)

    def recorded_output(self, tool_call_id: str) -> dict[str, Any] | None:
        """The recorded output of a call this replay produced (``call_<step>_<i>``); None when there is none."""
        match = self._call_id.fullmatch(tool_call_id)
        if not match:
            return None
        k, i = int(match.group(1)), int(match.group(2))
        if not (1 <= k <= len(self.script)):
            return None
        calls = self.script[k - 1].get("toolCalls", [])
        return calls[i - 1].get("output") if 1 <= i <= len(calls) else None

    @staticmethod
    def _step_index(messages: list[dict[str, Any]]) -> int:
        """Model calls already made in this turn = assistant messages after the last user message."""
        k = 0
        for m in reversed(messages):
            if m["role"] == "user":
                break
            if m["role"] == "assistant":
                k += 1
        return k

    async def complete(self, request: ModelRequest, *, step: int | None = None,
                       on_text: TextCallback | None = None) -> ModelResponse:
        """Answer model call ``step`` (1-based, of this turn) — the runner knows it; without it, infer it from
        the messages (wrong once in-loop compaction folded rows of this turn)."""
        if step is not None and step < 1:
            raise ProviderError(f"replay step must be >= 1, got {step}")
        k = step - 1 if step is not None else self._step_index(request.messages)
        if k >= len(self.script):
            raise ProviderError(f"replay script has {len(self.script)} steps; step {k + 1} requested")
        entry = self.script[k]
        parts: list[dict[str, Any]] = []
        if entry.get("text"):
            parts.append({"type": "text", "text": entry["text"]})
            if on_text is not None:
                await on_text(entry["text"])
        for i, call in enumerate(entry.get("toolCalls", [])):
            name = _resolve_tool_name(call["toolName"], [t.name for t in request.tools])
            parts.append({"type": "tool-call", "toolCallId": f"{self.call_id_prefix}_{k + 1}_{i + 1}",
                          "toolName": name,
                          "input": _substitute(call.get("input", {}), request.messages)})
        tools_json = json.dumps([t.as_dict() for t in request.tools], ensure_ascii=False)
        usage = {
            "inputTokens": count_text(request.system) + count_text(tools_json) + count_messages(request.messages),
            "outputTokens": count_messages([{"parts": parts}]),
        }
        stop = "tool_calls" if any(p["type"] == "tool-call" for p in parts) else "stop"
        return ModelResponse(parts=parts, usage=usage, stop_reason=stop)
