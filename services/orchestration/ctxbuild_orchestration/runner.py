"""The turn runner: turn-start compaction → tools → step loop (provider → tools → truncation) → persist.

Every step leaves events on the turn's stream `turn:<id>` (appended with expected versions: the runner is the
stream's only writer, so a second writer is a typed conflict, not a silent interleave). The conversation
stream receives the turn's messages once, at the end (AssistantMessageCompleted).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import structlog
from ctxbuild_codec.tokens import count_messages
from ctxbuild_platform.errors import RemoteError
from ctxbuild_platform.telemetry import span
from ctxbuild_providers import ModelRequest, Provider, ProviderError

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
        with span("compaction.turn_start"):
            start = await self.backends.turn_start(conversation_id, {
                **window, "compressEnabled": cs.get("compressEnabled", True), "maxMessages": cs.get("maxMessages")})
        d = start["decision"]
        # progress statuses (SPEC §8.10): a fold that happened is "done"; serving as is is "skipped" + why
        await ts.emit("CompactionDecided", {
            "turnId": turn_id, "phase": "turn-start", "status": "done" if d["status"] == "compacted" else "skipped",
            "reason": d.get("reason"), "preTokens": d.get("estimatedTokens"), "postTokens": d.get("postTokens"),
            "trigger": d.get("trigger"), "foldedCount": d.get("foldedCount")})
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

        for step in range(1, self.max_steps + 1):
            messages = served + turn_messages
            request = ModelRequest(model=self.model, system=SYSTEM_PROMPT, messages=messages, tools=tools)
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
