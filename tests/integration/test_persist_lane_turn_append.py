"""ctx.persist.complete_turn with ``turnAppend``: the turn's own closing events (its last StepServed and
TurnCompleted) in the same commit as the conversation's AssistantMessageCompleted — both or neither."""

from __future__ import annotations

import uuid

import asyncpg
import pytest
from ctxbuild_platform.errors import RemoteError

from tests.integration.test_persistence_lane import sample_turn, start_conversation
from tests.support.persistence import new_id


@pytest.fixture(scope="module")
def services(start_service) -> None:
    start_service("blobstore")
    start_service("persistence")


async def queued_turn(rpc, turn_id: str) -> None:
    await rpc.call("ctx.persist.append", {"streamId": f"turn:{turn_id}", "expectedVersion": 0, "events": [
        {"eventId": new_id(), "type": "TurnAbortRequested", "data": {"turnId": turn_id, "reason": "x"}}]})


def closing(turn_id: str, expected: int) -> dict:
    return {"streamId": f"turn:{turn_id}", "expectedVersion": expected, "events": [
        {"eventId": new_id(), "type": "TurnFailed", "data": {"turnId": turn_id, "code": "test", "message": "m"}}]}


async def types(rpc, stream: str) -> list[str]:
    got = await rpc.call("ctx.persist.read_stream", {"streamId": stream})
    return [e["type"] for e in got["events"]]


async def test_both_streams_in_one_commit_and_a_retry_is_a_no_op(services, rpc, stack):
    cid = await start_conversation(rpc)
    turn_id = new_id()
    await queued_turn(rpc, turn_id)
    req = {"conversationId": cid, "turnId": turn_id, "eventId": new_id(), "messages": sample_turn(turn_id),
           "turnAppend": closing(turn_id, 1)}
    first = await rpc.call("ctx.persist.complete_turn", req)
    assert first["turnAppend"]["fromVersion"] == 2 and first["turnAppend"]["duplicates"] == 0
    assert await types(rpc, f"conversation:{cid}") == ["UserMessageAdded", "AssistantMessageCompleted"]
    assert await types(rpc, f"turn:{turn_id}") == ["TurnAbortRequested", "TurnFailed"]
    conn = await asyncpg.connect(stack.env["CTX_DATABASE_URL"])
    try:
        txids = await conn.fetch("SELECT DISTINCT xmin::text AS x FROM persistence.events WHERE event_id = ANY($1)",
                                 [uuid.UUID(req["eventId"]), uuid.UUID(req["turnAppend"]["events"][0]["eventId"])])
    finally:
        await conn.close()
    assert len(txids) == 1  # one transaction wrote both streams
    again = await rpc.call("ctx.persist.complete_turn", req)  # the reply was lost: the same request again
    assert again["append"]["duplicates"] == 1 and again["turnAppend"]["duplicates"] == 1
    assert again["turnAppend"]["positions"] == first["turnAppend"]["positions"]
    assert await types(rpc, f"turn:{turn_id}") == ["TurnAbortRequested", "TurnFailed"]


async def test_a_conflict_on_the_turn_stream_stores_neither(services, rpc, stack):
    cid = await start_conversation(rpc)
    turn_id = new_id()
    await queued_turn(rpc, turn_id)
    req = {"conversationId": cid, "turnId": turn_id, "eventId": new_id(), "messages": sample_turn(turn_id),
           "turnAppend": closing(turn_id, 0)}  # stale: another writer moved the turn on
    with pytest.raises(RemoteError) as exc:
        await rpc.call("ctx.persist.complete_turn", req)
    assert exc.value.code == "version-conflict"
    assert await types(rpc, f"conversation:{cid}") == ["UserMessageAdded"]
    assert await types(rpc, f"turn:{turn_id}") == ["TurnAbortRequested"]
    conn = await asyncpg.connect(stack.env["CTX_DATABASE_URL"])
    try:
        left = await conn.fetchval("SELECT count(*) FROM blobstore.refs WHERE owner_id = $1", f"{turn_id}-t1")
    finally:
        await conn.close()
    assert left == 0  # the lane's references of the unstored messages are released, as for any refusal


async def test_only_the_turns_own_stream(services, rpc):
    cid = await start_conversation(rpc)
    turn_id = new_id()
    other = new_id()
    req = {"conversationId": cid, "turnId": turn_id, "eventId": new_id(), "messages": sample_turn(turn_id),
           "turnAppend": closing(other, 0)}
    with pytest.raises(RemoteError) as exc:
        await rpc.call("ctx.persist.complete_turn", req)
    assert exc.value.code == "invalid-payload"
    assert await types(rpc, f"conversation:{cid}") == ["UserMessageAdded"]
