"""A turn's state as a pure fold of its events (stream ``turn:<id>``): what a runner needs to start a turn, or to
resume one that another replica left mid-way (SIGKILL, drain). Nothing here does I/O.

Identity is deterministic so a resumed run produces the same bytes as the first one would have: message ids and
event ids are derived from (turn id, step, kind). Appending an event twice with the same id is a no-op in the
event store, and the persist lane is idempotent by its event id, so a crash between a write and its
acknowledgement cannot duplicate a message or complete a turn twice.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ctxbuild_codec.contract_models import event_model
from ctxbuild_codec.models.events.CompactionDecided import CompactionDecided
from ctxbuild_codec.models.events.InLoopFoldRecorded import InLoopFoldRecorded
from ctxbuild_codec.models.events.StepServed import StepServed
from ctxbuild_codec.models.events.ToolCallRequested import ToolCallRequested
from ctxbuild_codec.models.events.ToolResultRecorded import ToolResultRecorded
from ctxbuild_codec.models.events.TurnAbortRequested import TurnAbortRequested
from ctxbuild_codec.models.events.TurnCompleted import TurnCompleted
from ctxbuild_codec.models.events.TurnFailed import TurnFailed
from ctxbuild_codec.models.events.TurnQueued import TurnQueued
from ctxbuild_codec.models.events.TurnResumed import TurnResumed
from ctxbuild_codec.models.events.TurnStarted import TurnStarted
from pydantic import BaseModel

TERMINAL = frozenset({"TurnCompleted", "TurnFailed"})
_EVENT_NS = uuid.UUID("5f0c3c4e-6a37-4f0e-9a59-2f61d1c0a7b1")


def message_id(turn_id: str, step: int, kind: str) -> str:
    """The id of the assistant (``kind='a'``) or tool (``kind='t'``) message of ``step``: the same on every replica."""
    return "msg_" + hashlib.sha256(f"{turn_id}/{step}/{kind}".encode()).hexdigest()[:20]


def event_id(turn_id: str, *key: Any) -> str:
    """A stable event id for one logical fact of a turn (idempotent append on retry/resume)."""
    return str(uuid.uuid5(_EVENT_NS, "/".join([turn_id, *map(str, key)])))


@dataclass
class StepRecord:
    step: int
    assistant: dict[str, Any]
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # toolCallId → recorded tool-result part
    requested: set[str] = field(default_factory=set)  # toolCallIds announced with ToolCallRequested
    served_tokens: int = 0  # StepServed's: what the step served and how long the model took
    model_ms: float = 0.0

    @property
    def calls(self) -> list[dict[str, Any]]:
        return [p for p in self.assistant["parts"] if p.get("type") == "tool-call"]

    @property
    def complete(self) -> bool:
        """Every tool call of this step has its result recorded (a final-answer step is complete by itself)."""
        return all(c["toolCallId"] in self.results for c in self.calls)

    def tool_parts(self) -> list[dict[str, Any]]:
        """The recorded results in call order (the order the model asked for them)."""
        return [self.results[c["toolCallId"]] for c in self.calls if c["toolCallId"] in self.results]


@dataclass
class TurnState:
    turn_id: str
    version: int = 0
    command: dict[str, Any] | None = None  # TurnQueued data: what to run
    started: bool = False
    attempts: int = 0  # TurnStarted + TurnResumed
    turn_start_recorded: bool = False
    steps: dict[int, StepRecord] = field(default_factory=dict)
    checkpoint: dict[str, Any] | None = None  # last InLoopFoldRecorded (the memoised fold, SPEC §9)
    abort: dict[str, Any] | None = None  # TurnAbortRequested data
    terminal: dict[str, Any] | None = None  # {"type": …, "data": …}

    @property
    def done(self) -> bool:
        return self.terminal is not None

    @property
    def next_step(self) -> int:
        """The first step whose model call has not been recorded."""
        return max(self.steps, default=0) + 1

    def messages(self, user_message_id: str) -> list[dict[str, Any]]:
        """The turn's own messages so far (assistant, then its tool message once complete), parent-linked from the
        user message. An incomplete last step contributes its assistant message only; the runner finishes its
        tools before anything is served again."""
        out: list[dict[str, Any]] = []
        for k in sorted(self.steps):
            rec = self.steps[k]
            out.append(rec.assistant)
            if rec.calls and rec.complete:
                out.append({"id": message_id(self.turn_id, k, "t"), "parentId": rec.assistant["id"],
                            "role": "tool", "parts": rec.tool_parts(), "turnId": self.turn_id})
        return out

    def finished_messages(self, user_message_id: str) -> list[dict[str, Any]]:
        """The messages of the steps that finished (every call answered), up to the first unfinished one: what a
        failed turn keeps in the conversation (SPEC §15.4) — never an assistant message whose tool calls have no
        results (a provider would refuse the history)."""
        out: list[dict[str, Any]] = []
        for m in self.messages(user_message_id):
            if m["role"] == "assistant" and any(p.get("type") == "tool-call" for p in m["parts"]):
                step = next(k for k, r in self.steps.items() if r.assistant["id"] == m["id"])
                if not self.steps[step].complete:
                    break
            out.append(m)
        return out


def event_data(event: Mapping[str, Any]) -> BaseModel | None:
    """An event's ``data`` as its generated model (None for a type without a contract). The store holds only events
    that passed their contract on append (persistence validates every one), so this reads them back typed without
    validating again; nested values stay the very objects that were read (a message, an output, a checkpoint is
    stored and hashed again as it came, never re-serialized)."""
    model = event_model(event["type"])
    return model.model_construct(**event["data"]) if model is not None else None


def fold(turn_id: str, events: list[dict[str, Any]]) -> TurnState:
    """Events of ``turn:<turn_id>`` in version order → the state a runner resumes from."""
    st = TurnState(turn_id)
    for ev in events:
        st.version = ev.get("version", st.version + 1)
        d = ev["data"]
        match event_data(ev):
            case TurnQueued():
                st.command = d  # forwarded as recorded (settings, provider, trace)
            case TurnStarted() | TurnResumed():
                st.started = True
                st.attempts += 1
            case CompactionDecided(phase="turn-start"):
                st.turn_start_recorded = True
            case StepServed(step=step, assistantMessage=message) if message:
                st.steps[step] = StepRecord(step, message, served_tokens=d.get("servedTokens") or 0,
                                            model_ms=d.get("modelMs") or 0.0)
            case ToolCallRequested(step=step, toolCallId=call_id) if step in st.steps:
                st.steps[step].requested.add(call_id)
            case ToolResultRecorded(step=step) as r if step in st.steps:
                part = {"type": "tool-result", "toolCallId": r.toolCallId, "toolName": r.toolName,
                        "output": r.output}
                if r.effectiveToolName:
                    part["effectiveToolName"] = r.effectiveToolName
                if r.offload:
                    part["offload"] = r.offload
                st.steps[step].results[r.toolCallId] = part
            case InLoopFoldRecorded():
                st.checkpoint = {k: v for k, v in d.items() if k not in ("turnId", "step")}
            case TurnAbortRequested():
                st.abort = d
            case TurnCompleted() | TurnFailed():
                st.terminal = {"type": ev["type"], "data": d}
    return st
