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


def prefix_record(stream: str, cid: str) -> dict:
    return {"streamId": stream, "expectedVersion": 0, "events": [
        {"eventId": new_id(), "type": "GatewayPrefixRecorded", "data": {"conversationId": cid, "messageId": "m"}}]}


async def test_other_streams_join_the_same_commit_and_a_conflict_there_stores_nothing(services, rpc, stack):
    """``alsoAppend`` (a gateway answer's prefix record): in the turn's closing commit, after the turn's events; a
    conflict on it stores nothing of the request, and a retry of a stored request is a no-op for it too."""
    cid = await start_conversation(rpc)
    turn_id = new_id()
    await queued_turn(rpc, turn_id)
    taken = f"gwprefix:{new_id()}"
    await rpc.call("ctx.persist.append", prefix_record(taken, "another-conversation"))
    req = {"conversationId": cid, "turnId": turn_id, "eventId": new_id(), "messages": sample_turn(turn_id),
           "turnAppend": closing(turn_id, 1), "alsoAppend": [prefix_record(taken, cid)]}
    with pytest.raises(RemoteError) as exc:  # recorded first by another turn: nothing of this one is stored
        await rpc.call("ctx.persist.complete_turn", req)
    assert exc.value.code == "version-conflict"
    assert await types(rpc, f"conversation:{cid}") == ["UserMessageAdded"]
    assert await types(rpc, f"turn:{turn_id}") == ["TurnAbortRequested"]
    fresh = f"gwprefix:{new_id()}"
    req["alsoAppend"] = [prefix_record(fresh, cid)]
    first = await rpc.call("ctx.persist.complete_turn", req)
    assert [r["streamId"] for r in first["alsoAppend"]] == [fresh] and first["alsoAppend"][0]["fromVersion"] == 1
    assert first["alsoAppend"][0]["positions"][0] > first["turnAppend"]["positions"][-1]  # after the turn's events
    conn = await asyncpg.connect(stack.env["CTX_DATABASE_URL"])
    try:
        txids = await conn.fetch("SELECT DISTINCT xmin::text AS x FROM persistence.events WHERE event_id = ANY($1)",
                                 [uuid.UUID(req["eventId"]), uuid.UUID(req["alsoAppend"][0]["events"][0]["eventId"])])
    finally:
        await conn.close()
    assert len(txids) == 1
    again = await rpc.call("ctx.persist.complete_turn", req)
    assert again["alsoAppend"][0]["duplicates"] == 1 and again["alsoAppend"][0]["positions"] == \
        first["alsoAppend"][0]["positions"]


@pytest.mark.parametrize("stream", ["conversation", "turn", "twice"])
async def test_other_streams_are_other_streams(services, rpc, stream):
    cid = await start_conversation(rpc)
    turn_id = new_id()
    name = {"conversation": f"conversation:{cid}", "turn": f"turn:{turn_id}", "twice": f"gwprefix:{new_id()}"}[stream]
    also = [prefix_record(name, cid)] * (2 if stream == "twice" else 1)
    req = {"conversationId": cid, "turnId": turn_id, "eventId": new_id(), "messages": sample_turn(turn_id),
           "alsoAppend": also}
    with pytest.raises(RemoteError) as exc:
        await rpc.call("ctx.persist.complete_turn", req)
    assert exc.value.code == "invalid-payload" and "alsoAppend/" in exc.value.remote_message
    assert await types(rpc, f"conversation:{cid}") == ["UserMessageAdded"]
