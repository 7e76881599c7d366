"""A first attempt's model call does not wait for TurnStarted's append (issue #19): it runs beside it, and
TurnStarted guards what the call produces instead — its live text deltas are held until TurnStarted is stored, and
a TurnStarted refused by its expected version (an abort recorded before pick-up) cancels the call, with nothing of
it sent or recorded.

The runner runs over stand-ins for persistence (appends, one answered by the test's gate), compaction's turn-start
answer, the broker (what is published, by subject) and a provider whose call the test holds open."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from ctxbuild_orchestration.app.runner import TurnRunner
from ctxbuild_platform.errors import RemoteError
from ctxbuild_providers import ModelResponse

TURN, CONV, USER = "turn-1", "conv-1", "u1"
COMMAND = {"turnId": TURN, "conversationId": CONV, "userMessageId": USER, "trace": {},
           "provider": {"kind": "fake"}, "settings": {"contextWindow": 16_000}}
PATIENCE_S = 30.0  # only an upper bound for a wait that a correct runner ends at once


class Broker:
    """``broker.connection.publish`` as the runner's notices use it; ``changed`` is set on every message."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, dict[str, Any]]] = []
        self.changed = asyncio.Event()
        self.connection = self

    async def publish(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        self.messages.append((subject, json.loads(data)))
        self.changed.set()

    def deltas(self) -> list[tuple[int, str]]:
        return [(m["seq"], m["text"]) for s, m in self.messages if s == f"ctx.turn.delta.{TURN}"]

    async def until_deltas(self, n: int) -> None:
        while len(self.deltas()) < n:
            self.changed.clear()
            await self.changed.wait()


class Persistence:
    """The turn stream (version 1: TurnQueued) and the calls the runner makes; TurnStarted's append waits for
    ``decide`` — ``True``: stored, ``False``: refused because an abort was recorded first."""

    def __init__(self) -> None:
        self.stored: list[dict[str, Any]] = []
        self.version = 1
        self.decide: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.completed: list[dict[str, Any]] = []
        self.broker = Broker()
        self.rpc = SimpleNamespace(call=self.call, broker=self.broker)
        self.blobs = SimpleNamespace(release=self.release)
        self.patience_s = 0.0

    async def append(self, stream: str, events: list[dict[str, Any]], expected: int | None = None,
                     patience_s: float | None = None) -> dict[str, Any]:
        if any(e["type"] == "TurnStarted" for e in events) and not await self.decide:
            raise RemoteError("ctx.persist.append", "version-conflict", "expected 1, at 2", False)
        return self.store(events)

    def store(self, events: list[dict[str, Any]]) -> dict[str, Any]:
        self.stored.extend(events)
        self.version += len(events)
        return {"toVersion": self.version}

    async def read_stream(self, stream: str, from_version: int = 1, limit: int | None = None) -> dict[str, Any]:
        assert from_version == 2
        return {"events": [{"version": 2, "type": "TurnAbortRequested",
                            "data": {"turnId": TURN, "reason": "changed my mind"}}]}

    async def complete_turn(self, conversation_id: str, turn_id: str, messages: list[dict[str, Any]],
                            truncate_threshold: int | None, event_id: str | None = None,
                            turn_append: dict[str, Any] | None = None, also_append: Any = None,
                            end_notice: Any = None) -> dict[str, Any]:
        self.completed.append({"messages": messages, "turnAppend": turn_append})
        return {"turnAppend": self.store(turn_append["events"])} if turn_append else {}

    async def call(self, subject: str, payload: dict[str, Any], **kw: Any) -> dict[str, Any]:
        assert subject == "ctx.compact.turn_start", subject
        decision = {"status": "serve", "reason": "under-trigger", "estimatedTokens": 5}
        return {"messages": [{"id": USER, "parentId": None, "role": "user",
                              "parts": [{"type": "text", "text": "hello"}]}],
                "retained": {"fileAttachments": [], "persistedUris": []}, "decision": decision}

    async def release(self, owner: Any, role: str) -> None:
        pass

    def types(self) -> list[str]:
        return [e["type"] for e in self.stored]


class HeldOpenProvider:
    """Streams two chunks, then waits for ``go`` before the last chunk and its answer; ``asked``: the call is
    running, ``cancelled``: it was cancelled while waiting."""

    name = model = "fake"

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.go = asyncio.Event()
        self.cancelled = False

    async def complete(self, request: Any, *, on_text: Any = None) -> ModelResponse:
        await on_text("Hel")
        await on_text("lo")
        self.asked.set()
        try:
            await self.go.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        await on_text(" world")
        return ModelResponse([{"type": "text", "text": "Hello world"}], {"inputTokens": 5, "outputTokens": 2},
                             "stop")


def runner(backends: Persistence, provider: HeldOpenProvider) -> TurnRunner:
    async def make_provider(_spec, _cid, _tid):
        return provider

    return TurnRunner(backends, make_provider, local_turn_start_plan=False)


async def test_deltas_wait_for_turn_started_and_go_out_in_order_once_it_is_stored():
    backends, provider = Persistence(), HeldOpenProvider()
    run = asyncio.create_task(runner(backends, provider).run(TURN, 1, queued=COMMAND))
    await asyncio.wait_for(provider.asked.wait(), PATIENCE_S)  # the model is asked while TurnStarted is pending
    assert backends.broker.deltas() == [] and backends.stored == []
    backends.decide.set_result(True)
    # held deltas go out as soon as TurnStarted is stored, while the call still runs
    await asyncio.wait_for(backends.broker.until_deltas(2), PATIENCE_S)
    assert backends.broker.deltas() == [(0, "Hel"), (1, "lo")] and not run.done()
    provider.go.set()
    assert await asyncio.wait_for(run, PATIENCE_S) == "completed"
    assert backends.broker.deltas() == [(0, "Hel"), (1, "lo"), (2, " world")]
    assert backends.types() == ["TurnStarted", "CompactionDecided", "StepServed", "TurnCompleted"]


async def test_a_refused_turn_started_cancels_the_running_call_and_records_nothing_of_it():
    backends, provider = Persistence(), HeldOpenProvider()
    run = asyncio.create_task(runner(backends, provider).run(TURN, 1, queued=COMMAND))
    await asyncio.wait_for(provider.asked.wait(), PATIENCE_S)
    backends.decide.set_result(False)  # an abort was recorded before this runner picked the turn up
    assert await asyncio.wait_for(run, PATIENCE_S) == "failed"
    assert provider.cancelled
    assert backends.broker.deltas() == []
    assert backends.completed == []  # no answer joins the conversation
    assert backends.types() == ["TurnFailed"]  # nor the turn-start decision, nor the step
    failed = backends.stored[0]["data"]
    assert failed["code"] == "aborted" and "changed my mind" in failed["message"]
