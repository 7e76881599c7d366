"""The runner's first attempt trusts the command its work-queue message carries (ctx.turn.run ``command``) and does
not read the turn stream first: the expected-version append of TurnStarted is the check. A turn that moved on
before the runner picked it up (here: an abort recorded after TurnQueued) ends as that says — aborted, with no
TurnStarted — not as the stale command says. The first model call runs beside TurnStarted's append (issue #19), so
it may have been asked: nothing of it is recorded or streamed (its deltas are held until TurnStarted is stored)."""

from __future__ import annotations

import asyncio
import json
import uuid

import nats
import pytest
from ctxbuild_devstack.replica import Replica

pytestmark = pytest.mark.e2e

QUEUE_ENV = {"CTX_TURNS_STREAM": "CTX_TURNS_RUNNER_PATH", "CTX_TURNS_SUBJECT": "ctx.turn.run_runner_path_test",
             "CTX_TURNS_CONSUMER": "runner-path"}


@pytest.fixture(scope="module")
def runner(stack, all_services):
    r = Replica(stack, "orchestration", "runner-path", CTX_ROLE="runner", **QUEUE_ENV).wait_ready()
    yield r
    r.stop()


async def turn_events(rpc, turn_id: str, until_types: set[str], tries: int = 600) -> list[dict]:
    for _ in range(tries):
        page = await rpc.call("ctx.persist.read_stream", {"streamId": f"turn:{turn_id}", "fromVersion": 1})
        if until_types & {e["type"] for e in page["events"]}:
            return page["events"]
        await asyncio.sleep(0.1)
    raise AssertionError(f"turn:{turn_id} never reached {until_types}: {[e['type'] for e in page['events']]}")


async def queue_turn(rpc, stack, text: str, *, abort_first: bool) -> tuple[str, str]:
    cid, tid, uid = f"conv_{uuid.uuid4().hex[:16]}", f"turn_{uuid.uuid4().hex[:20]}", f"msg_{uuid.uuid4().hex[:16]}"
    await rpc.call("ctx.persist.append", {"streamId": f"conversation:{cid}", "expectedVersion": 0, "events": [
        {"eventId": str(uuid.uuid4()), "type": "ConversationCreated", "data": {"conversationId": cid}},
        {"eventId": str(uuid.uuid4()), "type": "UserMessageAdded",
         "data": {"message": {"id": uid, "role": "user", "parts": [{"type": "text", "text": text}]}}}]})
    command = {"turnId": tid, "conversationId": cid, "userMessageId": uid, "trace": {},
               "provider": {"kind": "replay", "script": [{"text": "answered"}]}, "settings": {"contextWindow": 16000}}
    events = [{"eventId": str(uuid.uuid4()), "type": "TurnQueued", "data": command}]
    if abort_first:
        events.append({"eventId": str(uuid.uuid4()), "type": "TurnAbortRequested",
                       "data": {"turnId": tid, "reason": "changed my mind"}})
    await rpc.call("ctx.persist.append", {"streamId": f"turn:{tid}", "expectedVersion": 0, "events": events})
    nc = await nats.connect(stack.env["CTX_NATS_URL"])
    try:
        body = {"turnId": tid, "conversationId": cid, "command": command}
        await nc.jetstream().publish(QUEUE_ENV["CTX_TURNS_SUBJECT"], json.dumps(body).encode(),
                                     headers={"Nats-Msg-Id": tid})
    finally:
        await nc.close()
    return cid, tid


async def seen_deltas(nc, sub, turn_id: str) -> list[str]:
    """The texts of the turn's live deltas received so far: the flush's round trip comes back after anything the
    server routed to this connection before it (a delta is sent before the turn's end is stored)."""
    await nc.flush()
    msgs = [await sub.next_msg() for _ in range(sub.pending_msgs)]
    return [json.loads(m.data)["text"] for m in msgs if m.subject == f"ctx.turn.delta.{turn_id}"]


async def run_queued(rpc, stack, *, abort_first: bool) -> tuple[str, str, list[dict], list[str]]:
    """Queue a turn and wait for its end: (conversation, turn, its events, the texts of its live deltas)."""
    nc = await nats.connect(stack.env["CTX_NATS_URL"])
    try:
        deltas = await nc.subscribe("ctx.turn.delta.*")
        await nc.flush()  # subscribed before the turn is queued
        cid, tid = await queue_turn(rpc, stack, "hello", abort_first=abort_first)
        evs = await turn_events(rpc, tid, {"TurnCompleted", "TurnFailed"})
        return cid, tid, evs, await seen_deltas(nc, deltas, tid)
    finally:
        await nc.close()


async def test_a_command_riding_in_the_message_runs_the_turn_and_ends_in_one_commit(runner, rpc, stack, pg):
    cid, _, evs, deltas = await run_queued(rpc, stack, abort_first=False)
    assert deltas == ["answered"]
    assert [e["type"] for e in evs] == ["TurnQueued", "TurnStarted", "CompactionDecided", "StepServed",
                                        "TurnCompleted"], [(e["type"], e["data"]) for e in evs[-1:]]
    served = evs[3]["data"]
    assert served["assistantMessage"]["parts"] == [{"type": "text", "text": "answered"}] and "request" in served
    conv = await rpc.call("ctx.persist.read_stream", {"streamId": f"conversation:{cid}", "fromVersion": 1})
    assert [e["type"] for e in conv["events"]][-1] == "AssistantMessageCompleted"
    # the turn's end — the answer on the conversation, the last StepServed and TurnCompleted — is one transaction
    ids = [uuid.UUID(e["eventId"]) for e in (conv["events"][-1], evs[3], evs[4])]
    txids = await pg.fetch("SELECT DISTINCT xmin::text FROM persistence.events WHERE event_id = ANY($1)", ids)
    assert len(txids) == 1, txids


async def test_a_stale_command_in_the_message_meets_the_abort(runner, rpc, stack):
    _, _, evs, deltas = await run_queued(rpc, stack, abort_first=True)
    # the replay model may have answered beside the refused TurnStarted: none of its text went out
    assert deltas == []
    assert [e["type"] for e in evs] == ["TurnQueued", "TurnAbortRequested", "TurnFailed"], [e["type"] for e in evs]
    assert evs[-1]["data"]["code"] == "aborted" and "changed my mind" in evs[-1]["data"]["message"]
