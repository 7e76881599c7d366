"""ctx.persist.complete_turn with ``endNotice``: persistence publishes the turn's end notice itself
(``ctx.turn.appended.<turnId>``, then ``ctx.turn.ended.<turnId>`` with the caller's body) right after the commit
that stores the turn's terminal event, and says so in the reply; refused unless that commit ends the turn the way
the notice says."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import nats
import pytest
from ctxbuild_platform.errors import RemoteError

from tests.integration.test_persist_lane_turn_append import closing, queued_turn, types
from tests.integration.test_persistence_lane import sample_turn, start_conversation
from tests.support.persistence import new_id


@pytest.fixture(scope="module")
def services(start_service) -> None:
    start_service("blobstore")
    start_service("persistence")


def completed(turn_id: str, expected: int) -> dict:
    return {"streamId": f"turn:{turn_id}", "expectedVersion": expected, "events": [
        {"eventId": new_id(), "type": "TurnCompleted", "data": {"turnId": turn_id, "steps": 1, "answer": "done"}}]}


class Heard:
    """The turn's live notices as they arrive; on the end notice, what the turn stream held at that moment."""

    def __init__(self, rpc: Any, turn_id: str) -> None:
        self.rpc, self.turn_id = rpc, turn_id
        self.notices: list[tuple[str, dict]] = []
        self.stored_at_end: list[str] | None = None
        self.ended = asyncio.Event()

    async def on_message(self, msg: Any) -> None:
        self.notices.append((msg.subject, json.loads(msg.data)))
        if msg.subject.startswith("ctx.turn.ended.") and self.stored_at_end is None:
            self.stored_at_end = await types(self.rpc, f"turn:{self.turn_id}")
            self.ended.set()


async def listening(stack, rpc, turn_id: str) -> tuple[Any, Heard]:
    nc = await nats.connect(stack.env["CTX_NATS_URL"], name="end-notice-test")
    heard = Heard(rpc, turn_id)
    await nc.subscribe(f"ctx.turn.*.{turn_id}", cb=heard.on_message)
    await nc.flush()
    return nc, heard


async def test_the_notice_goes_out_after_the_commit_with_its_body(services, rpc, stack):
    cid = await start_conversation(rpc)
    turn_id = new_id()
    await queued_turn(rpc, turn_id)
    result = {"text": "done — ünïcode", "toolCalls": [], "stopReason": "stop",
              "usage": {"inputTokens": 3, "outputTokens": 1}, "servedTokens": 3, "modelMs": 1.5}
    notice = {"turnId": turn_id, "type": "TurnCompleted", "result": result}
    nc, heard = await listening(stack, rpc, turn_id)
    try:
        req = {"conversationId": cid, "turnId": turn_id, "eventId": new_id(), "messages": sample_turn(turn_id),
               "turnAppend": completed(turn_id, 1), "endNotice": notice}
        reply = await rpc.call("ctx.persist.complete_turn", req)
        assert reply["endNoticeSent"] is True
        await asyncio.wait_for(heard.ended.wait(), timeout=10)
        assert heard.stored_at_end == ["TurnAbortRequested", "TurnCompleted"]
        assert heard.notices == [(f"ctx.turn.appended.{turn_id}", {"turnId": turn_id, "toVersion": 2}),
                                 (f"ctx.turn.ended.{turn_id}", notice)]
        # the reply was lost: the same request again stores nothing new and sends the notice again
        heard.ended.clear()
        heard.stored_at_end = None
        again = await rpc.call("ctx.persist.complete_turn", req)
        assert again["turnAppend"]["duplicates"] == 1 and again["endNoticeSent"] is True
        await asyncio.wait_for(heard.ended.wait(), timeout=10)
        assert heard.notices[2:] == heard.notices[:2]
    finally:
        await nc.drain()


async def test_no_end_notice_no_notice_sent(services, rpc, stack):
    cid = await start_conversation(rpc)
    turn_id = new_id()
    await queued_turn(rpc, turn_id)
    req = {"conversationId": cid, "turnId": turn_id, "eventId": new_id(), "messages": sample_turn(turn_id),
           "turnAppend": closing(turn_id, 1)}
    reply = await rpc.call("ctx.persist.complete_turn", req)
    assert "endNoticeSent" not in reply


def refused_case(case: str, turn_id: str) -> dict:
    """A request whose endNotice does not describe the end its commit stores."""
    ended = {"turnId": turn_id, "type": "TurnFailed"}
    if case == "no-turn-append":
        return {"endNotice": ended}
    if case == "no-terminal":
        return {"turnAppend": {"streamId": f"turn:{turn_id}", "expectedVersion": 1, "events": [
            {"eventId": new_id(), "type": "TurnAbortRequested", "data": {"turnId": turn_id, "reason": "x"}}]},
                "endNotice": ended}
    if case == "type-mismatch":  # the commit fails the turn, the notice says it completed
        return {"turnAppend": closing(turn_id, 1), "endNotice": {"turnId": turn_id, "type": "TurnCompleted"}}
    if case == "other-turn":
        return {"turnAppend": closing(turn_id, 1), "endNotice": {"turnId": str(uuid.uuid4()), "type": "TurnFailed"}}
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["no-turn-append", "no-terminal", "type-mismatch", "other-turn"])
async def test_an_end_notice_that_does_not_match_the_commit_is_refused(services, rpc, stack, case):
    cid = await start_conversation(rpc)
    turn_id = new_id()
    await queued_turn(rpc, turn_id)
    nc, heard = await listening(stack, rpc, turn_id)
    try:
        req = {"conversationId": cid, "turnId": turn_id, "eventId": new_id(), "messages": sample_turn(turn_id),
               **refused_case(case, turn_id)}
        with pytest.raises(RemoteError) as exc:
            await rpc.call("ctx.persist.complete_turn", req)
        assert exc.value.code == "invalid-payload" and "endNotice" in exc.value.remote_message
        assert await types(rpc, f"conversation:{cid}") == ["UserMessageAdded"]
        assert await types(rpc, f"turn:{turn_id}") == ["TurnAbortRequested"]
        await nc.flush()
        assert heard.notices == []
    finally:
        await nc.drain()
