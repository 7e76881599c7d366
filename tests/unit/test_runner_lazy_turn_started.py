"""A first attempt whose first model call is not streamed (a gateway client's non-streamed request) writes
TurnStarted lazily (issue #19): a call that answers within ``lazy_turn_start_s`` has it ride at the head of the
turn's closing commit — one commit fewer before the answer, the same expected version — while a slower call has it
written beside the call, and an abort met by the closing commit still ends the turn aborted with nothing of the call
recorded.

The stand-ins are the fence test's (persistence, broker, turn-start answer); the provider answers whole."""

from __future__ import annotations

import asyncio
from typing import Any

from ctxbuild_orchestration.app.runner import TurnRunner
from ctxbuild_platform.errors import RemoteError
from ctxbuild_providers import ModelResponse

from tests.unit.test_runner_model_call_fence import COMMAND, PATIENCE_S, TURN, Persistence

WHOLE = {**COMMAND, "provider": {"kind": "fake", "stream": False}}
ANSWER = "Hello world"


class Recording(Persistence):
    """Every append and closing commit as the runner sends it; ``refuse_close``: the closing commit meets an abort
    recorded meanwhile (version conflict), as does any later append carrying TurnStarted (``decide`` False)."""

    def __init__(self, refuse_close: bool = False) -> None:
        super().__init__()
        self.appends: list[list[str]] = []
        self.closing: list[list[str]] = []
        self.refuse_close = refuse_close

    async def append(self, stream: str, events: list[dict[str, Any]], expected: int | None = None,
                     patience_s: float | None = None) -> dict[str, Any]:
        self.appends.append([e["type"] for e in events])
        return await super().append(stream, events, expected, patience_s)

    async def complete_turn(self, conversation_id: str, turn_id: str, messages: list[dict[str, Any]],
                            truncate_threshold: int | None, event_id: str | None = None,
                            turn_append: dict[str, Any] | None = None, also_append: Any = None,
                            end_notice: Any = None) -> dict[str, Any]:
        if turn_append is not None:
            self.closing.append([e["type"] for e in turn_append["events"]])
            if self.refuse_close:
                raise RemoteError("ctx.persist.complete_turn", "version-conflict", "expected 1, at 2", False)
        return await super().complete_turn(conversation_id, turn_id, messages, truncate_threshold, event_id,
                                           turn_append, also_append, end_notice)


class WholeAnswer:
    """A non-streamed call: the whole text once, after ``go`` (set at once unless the test holds it)."""

    name = model = "fake"

    def __init__(self, held: bool = False) -> None:
        self.go = asyncio.Event()
        if not held:
            self.go.set()

    async def complete(self, request: Any, *, on_text: Any = None) -> ModelResponse:
        await self.go.wait()
        await on_text(ANSWER)
        return ModelResponse([{"type": "text", "text": ANSWER}], {"inputTokens": 5, "outputTokens": 2}, "stop")


def runner(backends: Persistence, provider: WholeAnswer, lazy_s: float) -> TurnRunner:
    async def make_provider(_spec, _cid, _tid):
        return provider

    return TurnRunner(backends, make_provider, local_turn_start_plan=False, lazy_turn_start_s=lazy_s)


async def test_a_quick_whole_answer_has_turn_started_ride_with_the_closing_commit():
    backends = Recording()
    backends.decide.set_result(True)
    assert await asyncio.wait_for(runner(backends, WholeAnswer(), 30.0).run(TURN, 1, queued=WHOLE),
                                  PATIENCE_S) == "completed"
    assert backends.appends == []  # no append of its own before the answer
    assert backends.closing == [["TurnStarted", "CompactionDecided", "StepServed", "TurnCompleted"]]
    assert backends.broker.deltas() == []  # the answer reaches the edge in the end notice


async def test_a_streamed_call_still_writes_turn_started_beside_it():
    backends = Recording()
    backends.decide.set_result(True)
    assert await asyncio.wait_for(runner(backends, WholeAnswer(), 30.0).run(TURN, 1, queued=COMMAND),
                                  PATIENCE_S) == "completed"
    assert backends.appends == [["TurnStarted"]]
    assert backends.closing == [["CompactionDecided", "StepServed", "TurnCompleted"]]
    assert backends.broker.deltas() == [(0, ANSWER)]


async def test_a_whole_answer_slower_than_the_grace_has_turn_started_written_beside_the_call():
    backends, provider = Recording(), WholeAnswer(held=True)
    backends.decide.set_result(True)
    run = asyncio.create_task(runner(backends, provider, 0.05).run(TURN, 1, queued=WHOLE))

    async def written() -> None:
        while not backends.appends:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(written(), PATIENCE_S)
    assert not run.done()  # written while the call is still held open, first, with what was deferred meanwhile
    assert backends.appends == [["TurnStarted", "CompactionDecided"]]
    provider.go.set()
    assert await asyncio.wait_for(run, PATIENCE_S) == "completed"
    assert backends.closing == [["StepServed", "TurnCompleted"]]
    assert backends.types() == ["TurnStarted", "CompactionDecided", "StepServed", "TurnCompleted"]


async def test_an_abort_met_by_the_closing_commit_ends_the_turn_aborted_with_nothing_of_the_call_recorded():
    backends = Recording(refuse_close=True)
    backends.decide.set_result(False)  # an abort was recorded while the call ran
    assert await asyncio.wait_for(runner(backends, WholeAnswer(), 30.0).run(TURN, 1, queued=WHOLE),
                                  PATIENCE_S) == "failed"
    assert backends.closing == [["TurnStarted", "CompactionDecided", "StepServed", "TurnCompleted"]]
    assert backends.completed == []  # no answer joins the conversation
    assert backends.types() == ["TurnFailed"]  # nor the turn-start decision, nor the step
    failed = backends.stored[0]["data"]
    assert failed["code"] == "aborted" and "changed my mind" in failed["message"]
