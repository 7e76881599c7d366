"""The turn runner: turn-start compaction → tools → step loop (in-loop compaction → provider → tools →
truncation) → persist.

Every step leaves events on the turn's stream `turn:<id>` (appended with expected versions: the runner is the
stream's only writer, so a second writer is a typed conflict, not a silent interleave). The conversation
stream receives the turn's messages once, at the end (AssistantMessageCompleted).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import structlog
from ctxbuild_codec.tokens import count_messages, count_text
from ctxbuild_platform.errors import RemoteError
from ctxbuild_platform.telemetry import span
from ctxbuild_providers import ModelRequest, Provider, ProviderError, ReplayProvider, ToolSpec

from .adapters.backends import Backends, new_event
from .domain.steps import assistant_message, tool_message, tool_result
from .domain.tools import BUILTINS, offered_tools

log = structlog.get_logger("runner")
SYSTEM_PROMPT = (
    "You are a careful assistant working inside ctxbuild. Large tool outputs may be shown as an excerpt with a "
    "<persisted-output> block; read the full text with fs_read when you need it."
)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


class TurnStream:
    """Appends to `turn:<id>` with optimistic concurrency."""

    def __init__(self, backends: Backends, turn_id: str) -> None:
        self.backends = backends
        self.stream = f"turn:{turn_id}"
        self.version = 0

    async def emit(self, type_: str, data: dict[str, Any]) -> None:
        reply = await self.backends.append(self.stream, [new_event(type_, data)], expected=self.version)
        self.version = reply["toVersion"]


COMPACTION_TIMEOUT_S = 120.0  # an llm summarizer call is a model call
SUMMARIZER_SETTINGS = ("summarizer", "summarizerModel", "summarizerWindow")


def fixed_tokens(system: str, tools: list[ToolSpec]) -> int:
    """Tokens every request carries besides its messages (the system prompt and the tool definitions)."""
    return count_text(system) + count_text(json.dumps([t.as_dict() for t in tools], ensure_ascii=False))


def progress(phase: str, turn_id: str, d: dict[str, Any], step: int | None = None) -> dict[str, Any]:
    """CompactionDecided from a compaction decision (SPEC §8.10): a fold that happened is "done"; anything else
    is "skipped" with its reason (and the fallback that was served, if any)."""
    data = {"turnId": turn_id, "phase": phase, "status": "done" if d["status"] == "compacted" else "skipped",
            "reason": d.get("reason"), "preTokens": d.get("estimatedTokens"), "postTokens": d.get("postTokens"),
            "trigger": d.get("trigger"), "foldedCount": d.get("foldedCount")}
    for key in ("startedAt", "completedAt", "durationMs", "summarizer", "fallback", "boundaryId", "consumedCount",
                "summarizerCalls", "summarizerInputTokens", "foldInput"):
        if d.get(key) is not None:
            data[key] = d[key]
    if step is not None:
        data["step"] = step
    return data


def pin_replay_step(provider: Provider, step: int) -> None:
    """A replay script is indexed by the model calls of the turn, which ReplayProvider counts from the messages
    (assistant rows after the last user row). Once in-loop compaction folded rows of this turn into a summary
    row that count is wrong, so the runner — which knows the step — tells it."""
    if isinstance(provider, ReplayProvider):
        provider._step_index = lambda _messages, k=step - 1: k  # type: ignore[method-assign]


class TurnRunner:
    def __init__(self, backends: Backends, max_steps: int = 20, model: str = "replay") -> None:
        self.backends = backends
        self.max_steps = max_steps
        self.model = model

    async def run(self, conversation_id: str, turn_id: str, user_message_id: str, provider: Provider,
                  conv_settings: dict[str, Any]) -> None:
        ts = TurnStream(self.backends, turn_id)
        with span("turn", **{"ctx.turn_id": turn_id, "ctx.conversation_id": conversation_id}):
            try:
                await ts.emit("TurnStarted", {"turnId": turn_id, "conversationId": conversation_id,
                                              "userMessageId": user_message_id})
                await self._run(conversation_id, turn_id, user_message_id, provider, conv_settings, ts)
            except asyncio.CancelledError:
                await asyncio.shield(self._fail(ts, turn_id, "cancelled", "the turn was cancelled"))
                raise
            except (RemoteError, ProviderError) as exc:
                code = getattr(exc, "code", "provider-error")
                log.warning("turn-failed", turn_id=turn_id, code=code, error=str(exc))
                await self._fail(ts, turn_id, code, str(exc))
            except Exception as exc:
                log.exception("turn-crashed", turn_id=turn_id)
                await self._fail(ts, turn_id, "internal", f"{type(exc).__name__}: {exc}")

    async def _fail(self, ts: TurnStream, turn_id: str, code: str, message: str) -> None:
        try:
            await ts.emit("TurnFailed", {"turnId": turn_id, "code": code, "message": message[:2000]})
        except RemoteError:
            log.error("turn-failed-not-recorded", turn_id=turn_id, code=code)

    async def _run(self, conversation_id: str, turn_id: str, user_message_id: str, provider: Provider,
                   cs: dict[str, Any], ts: TurnStream) -> None:
        window = {"contextWindow": cs.get("contextWindow"), "reservation": cs.get("reservation")}
        compaction = {**window, "compressEnabled": cs.get("compressEnabled", True),
                      **{k: cs[k] for k in SUMMARIZER_SETTINGS if cs.get(k) is not None},
                      "provider": getattr(provider, "name", None), "model": getattr(provider, "model", None)}
        with span("compaction.turn_start"):
            start = await self.backends.rpc.call("ctx.compact.turn_start", {
                "conversationId": conversation_id, "anchorId": user_message_id, "turnId": turn_id,
                "settings": {**compaction, "maxMessages": cs.get("maxMessages")}}, timeout=COMPACTION_TIMEOUT_S)
        await ts.emit("CompactionDecided", progress("turn-start", turn_id, start["decision"]))
        served: list[dict[str, Any]] = start["messages"]
        mcp_tools: list[dict[str, Any]] = []
        if cs.get("mcpMode", "manual") != "disabled":
            resolved = await self.backends.resolve_tools(cs.get("mcpMode", "manual"), cs.get("mcpServers", []))
            mcp_tools = resolved["tools"]
        tools = offered_tools(start["retained"], mcp_tools, can_offload=True)
        mcp_by_id = {t["id"]: t for t in mcp_tools}
        turn_messages: list[dict[str, Any]] = []
        parent = user_message_id
        trunc_settings = {"truncateThreshold": cs.get("truncateThreshold"), **window}

        fixed = fixed_tokens(SYSTEM_PROMPT, tools)
        checkpoint: dict[str, Any] | None = None  # the in-loop fold memo (SPEC §9); None = nothing folded yet

        for step in range(1, self.max_steps + 1):
            with span("compaction.in_loop", **{"ctx.step": step}):
                messages, checkpoint = await self._in_loop(conversation_id, turn_id, step, served + turn_messages,
                                                           checkpoint, start["retained"], fixed, compaction, ts)
            request = ModelRequest(model=self.model, system=SYSTEM_PROMPT, messages=messages, tools=tools)
            pin_replay_step(provider, step)
            with span("provider.call", **{"ctx.step": step}):
                response = await provider.complete(request)
            await ts.emit("StepServed", {"turnId": turn_id, "step": step, "servedTokens": count_messages(messages),
                                         "messagesServed": len(messages), "requestHash": request.digest(),
                                         "usage": response.usage})
            a_msg = assistant_message(new_id("msg"), parent, turn_id, response.parts, response.usage)
            turn_messages.append(a_msg)
            parent = a_msg["id"]
            if not response.tool_calls:
                await self.backends.complete_turn(conversation_id, turn_id, turn_messages,
                                                  cs.get("truncateThreshold"))
                await ts.emit("TurnCompleted", {"turnId": turn_id, "steps": step,
                                                "messageIds": [m["id"] for m in turn_messages]})
                return
            results = []
            for call in response.tool_calls:
                await ts.emit("ToolCallRequested", {"turnId": turn_id, "step": step, "toolCallId": call["toolCallId"],
                                                    "toolName": call["toolName"], "input": call["input"]})
                with span("tool", **{"ctx.tool": call["toolName"]}):
                    output = await self._execute(conversation_id, turn_id, call, mcp_by_id)
                results.append(tool_result(call, output))
            with span("truncation.step", **{"ctx.step": step}):
                try:
                    trimmed = (await self.backends.truncate_step(conversation_id, turn_id, trunc_settings,
                                                                 results))["parts"]
                except RemoteError as exc:
                    # better fat than lost: serve the full outputs if the truncation service is unavailable
                    log.warning("truncation-unavailable", turn_id=turn_id, error=str(exc))
                    trimmed = results
            for part in trimmed:
                await ts.emit("ToolResultRecorded", {
                    "turnId": turn_id, "step": step, "toolCallId": part["toolCallId"], "toolName": part["toolName"],
                    "output": part["output"], "trimmed": "offload" in part,
                    **({"offload": part["offload"]} if "offload" in part else {})})
            t_msg = tool_message(new_id("msg"), parent, turn_id, trimmed)
            turn_messages.append(t_msg)
            parent = t_msg["id"]
        await ts.emit("TurnFailed", {"turnId": turn_id, "code": "step-limit",
                                     "message": f"the turn needed more than {self.max_steps} model calls"})

    async def _in_loop(self, conversation_id: str, turn_id: str, step: int, full: list[dict[str, Any]],
                       checkpoint: dict[str, Any] | None, retained: dict[str, Any], fixed: int,
                       settings: dict[str, Any], ts: TurnStream) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """What step ``step`` serves: ctx.compact.in_loop on the turn's candidate (only the messages the
        checkpoint has not consumed travel). A new checkpoint is made durable here — the runner is the turn
        stream's only writer — as InLoopFoldRecorded, and every fold (or failed fold) as CompactionDecided."""
        offset = checkpoint["consumedCount"] if checkpoint else 0
        try:
            reply = await self.backends.rpc.call("ctx.compact.in_loop", {
                "conversationId": conversation_id, "turnId": turn_id, "step": step, "offset": offset,
                "messages": full[offset:], "checkpoint": checkpoint, "retained": retained, "fixedTokens": fixed,
                "settings": settings}, timeout=COMPACTION_TIMEOUT_S)
        except RemoteError as exc:
            # compaction unavailable: serve the candidate as the last checkpoint has it (nothing is lost)
            log.warning("in-loop-compaction-unavailable", turn_id=turn_id, step=step, error=str(exc))
            prefix = checkpoint["compactedPrefix"] if checkpoint else []
            return [*prefix, *full[offset:]], checkpoint
        new = reply["checkpoint"]
        if reply["checkpointChanged"]:
            await ts.emit("InLoopFoldRecorded", {"turnId": turn_id, **new, "step": step})
        d = reply["decision"]
        if d["status"] != "serve":
            await ts.emit("CompactionDecided", progress("in-loop", turn_id, d, step))
        return reply["messages"], new

    async def _execute(self, conversation_id: str, turn_id: str, call: dict[str, Any],
                       mcp_by_id: dict[str, dict[str, Any]]) -> dict[str, Any]:
        name, args = call["toolName"], call.get("input") or {}
        try:
            if name == "read_file":
                r = await self.backends.read_file(conversation_id, args)
                return {"type": "error-text" if "error" in r else "text", "value": r["modelText"]}
            if name == "fs_read":
                r = await self.backends.fs_read(conversation_id, turn_id, args)
                return {"type": "error-text" if r.get("kind") == "error" else "text", "value": r["modelText"]}
            if name in mcp_by_id:
                return (await self.backends.invoke(name, args, call["toolCallId"]))["output"]
        except RemoteError as exc:
            return {"type": "error-text", "value": f"[Error: {exc.code}] {exc.remote_message}"}
        known = sorted(BUILTINS | set(mcp_by_id))
        return {"type": "error-text", "value": f"[Error: unknown-tool] {name} is not available; tools: {known}"}
