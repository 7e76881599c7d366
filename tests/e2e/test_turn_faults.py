"""Faults (SPEC §15.4, issue #16) on the real stack, with real service processes: a poison turn command is parked
on the dead-letter stream and the next turn runs; readiness follows the turn consumer; a turn whose persistence
goes away mid-turn still ends with exactly one terminal event once it is back; abort ends turns no runner holds
(queued, admitted and never queued) and frees the conversation; malformed request/reply payloads are typed
``invalid-payload``; with compaction down every served request stays within the window; a failed turn's finished
steps are in the conversation."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid

import httpx
import nats
import pytest
from ctxbuild_devstack.replica import Replica
from ctxbuild_devstack.stack import free_port
from nats.js.api import ConsumerConfig, DeliverPolicy
from starlette.responses import PlainTextResponse

from tests.e2e.test_durable_turns import SlowPages, fetch_script
from tests.support.auth import AUTH

pytestmark = pytest.mark.e2e

STREAM, SUBJECT, CONSUMER = "CTX_TURNS_FAULTS", "ctx.turn.run_faults_test", "faults-runner"
QUEUE_ENV = {"CTX_TURNS_STREAM": STREAM, "CTX_TURNS_SUBJECT": SUBJECT, "CTX_TURNS_CONSUMER": CONSUMER,
             "CTX_TURN_ACK_WAIT_S": "5"}
DLQ = "CTX_DEAD_LETTERS"


class FaultPages(SlowPages):
    """SlowPages whose long articles are this module's own (content-addressed blobs shared with another module's
    identical pages would mix their references)."""

    async def page(self, request):
        if request.url.path.startswith("/big/"):
            self.hits[request.url.path] += 1
            return PlainTextResponse("".join(f"{request.url.path} paragraph {i}: " + "fault text " * 12 + "\n"
                                             for i in range(3000)))
        return await super().page(request)


@pytest.fixture(scope="module")
def pages():
    server = FaultPages(free_port(), delay_s=0.4).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def edge(stack, all_services):
    e = Replica(stack, "orchestration", "faults-edge", CTX_ROLE="edge", CTX_ABORT_GRACE_S="2",
                CTX_ADMISSION_GRACE_S="2", **QUEUE_ENV).wait_ready()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def runner(stack, edge):
    r = Replica(stack, "orchestration", "faults-runner", CTX_ROLE="runner", CTX_ALLOW_PRIVATE_NETWORKS="true",
                CTX_TRUNCATE_ATTEMPT_TIMEOUT_S="3", CTX_TRUNCATE_ATTEMPTS="4", CTX_KEEP_REQUEST_PATIENCE_S="2",
                **QUEUE_ENV).wait_ready()
    yield r
    r.stop()


# ----------------------------------------------------------------------------------------------- helpers
def get(url: str, **kw) -> httpx.Response | None:
    """None while the edge cannot answer (a dependency is being restarted by the test)."""
    try:
        r = httpx.get(url, headers=AUTH, timeout=30, **kw)
    except httpx.HTTPError:
        return None
    return r if r.status_code == 200 else None


def events_of(base: str, cid: str, tid: str) -> list[dict] | None:
    r = get(f"{base}/v1/conversations/{cid}/turns/{tid}")
    return r.json()["events"] if r is not None else None


def terminal(evs: list[dict] | None) -> list[dict]:
    return [e for e in evs or [] if e["type"] in ("TurnCompleted", "TurnFailed")]


def wait_for(base: str, cid: str, tid: str, pred, timeout: float = 180) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        evs = events_of(base, cid, tid)
        if evs is not None and pred(evs):
            return evs
        time.sleep(0.2)
    raise AssertionError(f"condition not reached; events: {[e['type'] for e in events_of(base, cid, tid) or []]}")


def conversation(base: str, title: str, **settings) -> str:
    r = httpx.post(f"{base}/v1/conversations", headers=AUTH, json={"title": title, "settings": settings}, timeout=30)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def start_turn(base: str, cid: str, text: str, script: list[dict], max_steps: int | None = None) -> str:
    body = {"text": text, "provider": {"kind": "replay", "script": script}}
    if max_steps:
        body["maxSteps"] = max_steps
    r = httpx.post(f"{base}/v1/conversations/{cid}/turns", headers=AUTH, json=body, timeout=30)
    assert r.status_code == 202, r.text
    return r.json()["turnId"]


def messages(base: str, cid: str) -> list[dict]:
    r = get(f"{base}/v1/conversations/{cid}/messages")
    assert r is not None
    return r.json()["messages"]


def until(probe, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := probe()) is not None and value is not False:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what}: not reached")


def readyz(replica: Replica) -> tuple[int, dict]:
    r = httpx.get(f"{replica.url}/readyz", timeout=10)
    return r.status_code, r.json()


async def dead_letters_for(nc, subject: str) -> list:
    """Every parked message of ``subject`` so far (an ephemeral ordered read of the dead-letter stream)."""
    js = nc.jetstream()
    sub = await js.pull_subscribe(f"ctx.dlq.{subject}", stream=DLQ, config=ConsumerConfig(
        deliver_policy=DeliverPolicy.ALL, inactive_threshold=30))
    out = []
    try:
        while True:
            try:
                out += await sub.fetch(100, timeout=1)
            except (TimeoutError, nats.errors.TimeoutError):
                return out
    finally:
        await sub.unsubscribe()


# ----------------------------------------------------------------------------------------------- poison + readiness
async def test_a_poison_command_is_parked_and_the_next_turn_runs(stack, edge, runner):
    nc = await nats.connect(stack.env["CTX_NATS_URL"])
    try:
        js = nc.jetstream()
        deep = b"[" * 50_000 + b"]" * 50_000  # a RecursionError in json.loads: it once ended the pull loop
        surrogate = b'{"turnId":"turn_x","conversationId":"\\ud800"}'
        await js.publish(SUBJECT, deep, headers={"Nats-Msg-Id": f"poison-{uuid.uuid4()}"})
        await js.publish(SUBJECT, surrogate, headers={"Nats-Msg-Id": f"poison-{uuid.uuid4()}"})
        for notice in ("ctx.turn.abort", "ctx.mcp.tools_changed"):  # core NATS notifications: dropped, no harm
            await nc.publish(notice, deep)
        parked = await until_async(lambda: dead_letters_for(nc, SUBJECT), lambda ms: len(ms) >= 2)
    finally:
        await nc.close()
    by_body = {m.data: m for m in parked}
    assert deep in by_body and surrogate in by_body  # the original payload, byte for byte
    h = by_body[deep].headers
    assert h["Ctx-Dlq-Subject"] == SUBJECT and h["Ctx-Dlq-Stream"] == STREAM and h["Ctx-Dlq-Consumer"] == CONSUMER
    assert h["Ctx-Dlq-Reason"].startswith("invalid-payload") and "RecursionError" in h["Ctx-Dlq-Reason"]
    assert h["Ctx-Dlq-Deliveries"] == "1" and h["Ctx-Dlq-Size"] == str(len(deep))
    assert by_body[surrogate].headers["Ctx-Dlq-Reason"].startswith("invalid-payload")

    # the loop survived: ready, consuming, and the next turn runs to its end
    status, body = readyz(runner)
    assert status == 200 and body["consumers"][0]["state"] == "consuming", body
    cid = conversation(edge.url, "after poison")
    tid = start_turn(edge.url, cid, "hello", [{"text": "still here"}])
    end = terminal(wait_for(edge.url, cid, tid, terminal))
    assert [e["type"] for e in end] == ["TurnCompleted"]


async def until_async(fetch, pred, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await fetch()
        if pred(value):
            return value
        await asyncio.sleep(0.3)
    raise AssertionError("condition not reached")


async def test_readiness_reflects_a_consumer_that_is_not_consuming(stack, edge, runner):
    """The durable consumer deleted under the runner: its fetches fail, /readyz says so (503, naming the
    consumer); the loop recreates it and readiness comes back, and turns run again."""
    nc = await nats.connect(stack.env["CTX_NATS_URL"])
    try:
        await nc.jetstream().delete_consumer(STREAM, CONSUMER)
    finally:
        await nc.close()
    _, body = until(lambda: (s := readyz(runner))[0] == 503 and s, "not ready")
    assert f"consumer:{CONSUMER}" in body["failing"] and body["consumers"][0]["state"] == "failing", body
    until(lambda: readyz(runner)[0] == 200, "ready again")
    cid = conversation(edge.url, "after the consumer came back")
    tid = start_turn(edge.url, cid, "hello", [{"text": "back"}])
    assert [e["type"] for e in terminal(wait_for(edge.url, cid, tid, terminal))] == ["TurnCompleted"]


# ----------------------------------------------------------------------------------------------- terminal guarantee
def test_a_turn_ends_once_after_persistence_comes_back(stack, edge, runner, pages):
    """Persistence SIGKILLed mid-turn and started again seconds later: the runner's appends wait for it, the turn
    completes (one terminal event), every finished step is in the conversation."""
    cid = conversation(edge.url, "persistence away")
    tid = start_turn(edge.url, cid, "read six pages", fetch_script(pages, "pgaway", 6))
    wait_for(edge.url, cid, tid, lambda evs: any(e["type"] == "ToolResultRecorded" for e in evs))
    stack.stop("persistence", sig=signal.SIGKILL)
    time.sleep(4)  # away for a while (not an assertion: the outage's length)
    stack.start_service("persistence")
    evs = wait_for(edge.url, cid, tid, terminal)
    end = terminal(evs)
    assert [e["type"] for e in end] == ["TurnCompleted"], [e["type"] for e in evs]
    assert sum(1 for e in evs if e["type"] == "StepServed") == 7
    mine = [m for m in messages(edge.url, cid) if m.get("turnId") == tid]
    assert len(mine) == 13 and len({m["id"] for m in mine}) == 13  # 6 × (assistant + tool) + the answer, once


def test_a_turn_ends_once_after_postgres_comes_back(stack, edge, runner, pages):
    """Postgres stopped mid-turn for seconds (persistence answers `unavailable` meanwhile) and started again: the
    turn completes once, its messages in the conversation once."""
    cid = conversation(edge.url, "postgres away")
    tid = start_turn(edge.url, cid, "read five pages", fetch_script(pages, "pgdown", 5))
    wait_for(edge.url, cid, tid, lambda evs: any(e["type"] == "ToolResultRecorded" for e in evs))
    stack.stop("postgres")
    try:
        time.sleep(5)  # away for a while (not an assertion: the outage's length)
    finally:
        stack.start_infra(["postgres"])
    evs = wait_for(edge.url, cid, tid, terminal)
    assert [e["type"] for e in terminal(evs)] == ["TurnCompleted"], [e["type"] for e in evs]
    mine = [m for m in messages(edge.url, cid) if m.get("turnId") == tid]
    assert len(mine) == 11 and len({m["id"] for m in mine}) == 11


def test_a_frozen_truncation_replica_does_not_stall_the_turn(stack, edge, runner, pages):
    """A second truncation replica frozen (SIGSTOP: subscribed, never answering — a dead node the server has not
    noticed yet): requests it takes time out after a short attempt and go to the live replica; the turn completes
    with its outputs trimmed."""
    frozen = Replica(stack, "truncation", "faults-trunc-frozen").wait_ready()
    os.killpg(frozen.proc.pid, signal.SIGSTOP)
    try:
        cid = conversation(edge.url, "frozen truncation", contextWindow=32000)
        script = [{"toolCalls": [{"toolName": "web_fetch", "input": {"url": pages.url(f"big/frozen{k}")}}]}
                  for k in range(1, 5)] + [{"text": "done"}]
        tid = start_turn(edge.url, cid, "read four long articles", script)
        evs = wait_for(edge.url, cid, tid, terminal)
    finally:
        frozen.kill()  # SIGKILL, never thawed: it must not answer (and write blobs for) the requests it holds
    assert [e["type"] for e in terminal(evs)] == ["TurnCompleted"]
    results = [e["data"] for e in evs if e["type"] == "ToolResultRecorded"]
    assert len(results) == 4 and any(r["trimmed"] for r in results)


def test_served_requests_are_kept_or_recorded_missing_while_s3_is_away(stack, edge, runner, pages):
    """S3 stopped before a turn: each step's request (over 16 KiB: a blob) is retried, then StepServed records why
    it is missing; the turn completes. A small request needs no blob: kept in StepServed all the same. S3 back: the
    next turn's large requests are kept again."""
    cid = conversation(edge.url, "s3 away")
    # the message stays inline (its parts ≤ 16 KiB of JSON: the edge needs no S3), the request it is served in
    # does not (with the system prompt and the tools)
    large = "three steps over a long brief: " + "z" * 16_000
    stack.stop("s3")
    try:
        tid = start_turn(edge.url, cid, large, fetch_script(pages, "s3away", 2))
        evs = wait_for(edge.url, cid, tid, terminal)
        small_cid = conversation(edge.url, "s3 away, small")
        small_tid = start_turn(edge.url, small_cid, "hi", [{"text": "kept inline"}])
        small = [e["data"] for e in wait_for(edge.url, small_cid, small_tid, terminal) if e["type"] == "StepServed"]
    finally:
        stack.start_infra(["s3"])
    assert [e["type"] for e in terminal(evs)] == ["TurnCompleted"], terminal(evs)
    served = [e["data"] for e in evs if e["type"] == "StepServed"]
    assert len(served) == 3 and all(("request" in s) != ("requestMissing" in s) for s in served)
    assert any(s.get("requestMissing") for s in served)
    assert small and all("body" in s["request"] for s in small)
    tid2 = start_turn(edge.url, cid, "after s3 is back", [{"text": "kept"}])
    served2 = [e["data"] for e in wait_for(edge.url, cid, tid2, terminal) if e["type"] == "StepServed"]
    assert served2 and all("request" in s and "body" not in s["request"] for s in served2)


# ----------------------------------------------------------------------------------------------- abort
def test_abort_ends_a_queued_turn_whose_command_was_lost(stack, all_services):
    """An edge whose work queue no runner pulls: its turns are admitted and queued, and their commands are as good
    as lost. Abort ends such a turn at once and the conversation takes a new turn."""
    lost = Replica(stack, "orchestration", "faults-edge-lost", CTX_ROLE="edge", CTX_TURNS_STREAM="CTX_TURNS_LOST",
                   CTX_TURNS_SUBJECT="ctx.turn.run_lost_test", CTX_TURNS_CONSUMER="lost-runner").wait_ready()
    try:
        cid = conversation(lost.url, "lost command")
        tid = start_turn(lost.url, cid, "hello", [{"text": "never"}])
        blocked = httpx.post(f"{lost.url}/v1/conversations/{cid}/turns", headers=AUTH, timeout=30,
                             json={"text": "next", "provider": {"kind": "replay", "script": [{"text": "x"}]}})
        assert blocked.status_code == 409  # the lost turn holds the conversation
        r = httpx.post(f"{lost.url}/v1/conversations/{cid}/turns/{tid}/abort", headers=AUTH,
                       json={"reason": "stuck"}, timeout=30)
        assert r.status_code == 202 and r.json()["status"] == "aborted", r.text
        end = terminal(events_of(lost.url, cid, tid))
        assert len(end) == 1 and end[0]["data"]["code"] == "aborted" and "stuck" in end[0]["data"]["message"]
        again = httpx.post(f"{lost.url}/v1/conversations/{cid}/turns", headers=AUTH, timeout=30,
                           json={"text": "next", "provider": {"kind": "replay", "script": [{"text": "x"}]}})
        assert again.status_code == 202, again.text  # the lock is free
    finally:
        lost.stop()


def test_abort_ends_a_running_turn_whose_runner_died(stack, all_services, pages):
    """The runner SIGKILLed mid-turn and no other replica on its queue: the abort's wake-up reaches nobody, and
    the edge ends the turn after its grace; the conversation is free."""
    env = {"CTX_TURNS_STREAM": "CTX_TURNS_ORPHAN", "CTX_TURNS_SUBJECT": "ctx.turn.run_orphan_test",
           "CTX_TURNS_CONSUMER": "orphan-runner", "CTX_TURN_ACK_WAIT_S": "30"}
    edge2 = Replica(stack, "orchestration", "faults-edge-orphan", CTX_ROLE="edge", CTX_ABORT_GRACE_S="1",
                    **env).wait_ready()
    doomed = Replica(stack, "orchestration", "faults-runner-orphan", CTX_ROLE="runner",
                     CTX_ALLOW_PRIVATE_NETWORKS="true", **env).wait_ready()
    try:
        cid = conversation(edge2.url, "orphaned turn")
        tid = start_turn(edge2.url, cid, "read eight pages", fetch_script(pages, "orphan", 8))
        wait_for(edge2.url, cid, tid, lambda evs: any(e["type"] == "ToolResultRecorded" for e in evs))
        doomed.kill()
        r = httpx.post(f"{edge2.url}/v1/conversations/{cid}/turns/{tid}/abort", headers=AUTH,
                       json={"reason": "runner gone"}, timeout=30)
        assert r.status_code == 202 and r.json()["status"] == "abort-requested", r.text
        evs = wait_for(edge2.url, cid, tid, terminal, timeout=60)
        end = terminal(evs)
        assert len(end) == 1 and end[0]["data"]["code"] == "aborted" and "runner gone" in end[0]["data"]["message"]
        # the edge that ended it kept the dead runner's finished steps, as the runner would have (SPEC §15.4)
        finished = sum(e["type"] == "ToolResultRecorded" for e in evs)
        assert finished >= 1
        mine = until(lambda: (ms := [m for m in messages(edge2.url, cid) if m.get("turnId") == tid]) and ms,
                     "the dead runner's finished steps in the conversation")
        assert len(mine) in (2 * finished, 2 * finished - 2), (finished, len(mine))
        calls = [p["toolCallId"] for m in mine for p in m["parts"] if p["type"] == "tool-call"]
        assert calls and sorted(calls) == sorted(p["toolCallId"] for m in mine for p in m["parts"]
                                                  if p["type"] == "tool-result")
        nxt = httpx.post(f"{edge2.url}/v1/conversations/{cid}/turns", headers=AUTH, timeout=30,
                         json={"text": "next", "provider": {"kind": "replay", "script": [{"text": "x"}]}})
        assert nxt.status_code == 202, nxt.text  # the lock is free
    finally:
        doomed.kill()
        edge2.stop()


async def test_abort_frees_a_turn_that_was_admitted_and_never_queued(edge, runner, rpc):
    cid = conversation(edge.url, "admitted only")
    tid = f"turn_{uuid.uuid4().hex[:20]}"
    await rpc.call("ctx.persist.append", {"streamId": f"conversation-turns:{cid}", "expectedVersion": 0, "events": [
        {"eventId": str(uuid.uuid4()), "type": "TurnAdmitted", "data": {"turnId": tid, "userMessageId": "msg_x"}}]})
    async with httpx.AsyncClient(headers=AUTH, timeout=30) as http:
        r = await http.post(f"{edge.url}/v1/conversations/{cid}/turns/{tid}/abort")
    assert r.status_code == 202 and r.json()["status"] == "aborted", r.text
    stored = await rpc.call("ctx.persist.read_stream", {"streamId": f"turn:{tid}", "fromVersion": 1})
    assert [e["type"] for e in stored["events"]] == ["TurnFailed"]
    async with httpx.AsyncClient(headers=AUTH, timeout=30) as http:
        again = await http.post(f"{edge.url}/v1/conversations/{cid}/turns/{tid}/abort")
    assert again.status_code == 409 and again.json()["code"] == "conflict"
    nxt = start_turn(edge.url, cid, "next", [{"text": "free again"}])
    assert [e["type"] for e in terminal(wait_for(edge.url, cid, nxt, terminal))] == ["TurnCompleted"]


async def test_a_turn_recorded_but_never_submitted_is_submitted_again_and_runs(edge, runner, rpc):
    """The edge died (or lost persistence's reply) between the commit of a turn's command and its submission to the
    work queue: the command is stored, nobody will run it, and its admission holds the conversation. A request
    for the conversation after the admission grace submits it again: it runs and ends, and the conversation is
    free once it has."""
    cid = conversation(edge.url, "stranded command")
    tid, mid = f"turn_{uuid.uuid4().hex[:20]}", f"msg_{uuid.uuid4().hex[:20]}"
    message = {"id": mid, "parentId": None, "role": "user", "parts": [{"type": "text", "text": "run me"}]}
    command = {"turnId": tid, "conversationId": cid, "userMessageId": mid, "settings": {}, "trace": {},
               "provider": {"kind": "replay", "script": [{"text": "ran after all"}]}}

    def event(type_: str, data: dict) -> dict:
        return {"eventId": str(uuid.uuid4()), "type": type_, "data": data}

    # what the edge commits for a turn, then nothing: no submission
    await rpc.call("ctx.persist.append_batch", {"appends": [
        {"streamId": f"conversation-turns:{cid}", "expectedVersion": 0,
         "events": [event("TurnAdmitted", {"turnId": tid, "userMessageId": mid})]},
        {"streamId": f"conversation:{cid}", "expectedVersion": None,
         "events": [event("UserMessageAdded", {"message": message})]},
        {"streamId": f"turn:{tid}", "expectedVersion": 0, "events": [event("TurnQueued", command)]}]})
    await asyncio.sleep(2.5)  # the edge's admission grace (CTX_ADMISSION_GRACE_S=2)
    assert [e["type"] for e in events_of(edge.url, cid, tid)] == ["TurnQueued"]  # nothing ran it
    async with httpx.AsyncClient(headers=AUTH, timeout=30) as http:
        busy = await http.post(f"{edge.url}/v1/conversations/{cid}/turns",
                               json={"text": "next", "provider": {"kind": "replay", "script": [{"text": "x"}]}})
    assert busy.status_code == 409, busy.text  # still its turn: it is submitted again, not dropped
    evs = await asyncio.to_thread(wait_for, edge.url, cid, tid, terminal, 60)
    assert [e["type"] for e in terminal(evs)] == ["TurnCompleted"]
    assert terminal(evs)[0]["data"]["answer"] == "ran after all"
    nxt = start_turn(edge.url, cid, "next", [{"text": "free again"}])
    assert [e["type"] for e in terminal(await asyncio.to_thread(wait_for, edge.url, cid, nxt, terminal))] == \
        ["TurnCompleted"]


def test_an_aborted_turn_keeps_its_finished_steps(edge, runner, pages):
    cid = conversation(edge.url, "abort keeps work")
    tid = start_turn(edge.url, cid, "read eight pages", fetch_script(pages, "keep", 8))
    wait_for(edge.url, cid, tid, lambda evs: sum(e["type"] == "ToolResultRecorded" for e in evs) >= 2)
    r = httpx.post(f"{edge.url}/v1/conversations/{cid}/turns/{tid}/abort", headers=AUTH, json={"reason": "enough"},
                   timeout=30)
    assert r.status_code == 202, r.text
    evs = wait_for(edge.url, cid, tid, terminal)
    end = terminal(evs)
    assert len(end) == 1 and end[0]["type"] == "TurnFailed" and end[0]["data"]["code"] == "aborted"
    finished = sum(e["type"] == "ToolResultRecorded" for e in evs)
    mine = until(lambda: (ms := [m for m in messages(edge.url, cid) if m.get("turnId") == tid])
                 and len(ms) >= 2 * 2 and ms, "finished steps in the conversation")
    assert len(mine) in (2 * finished, 2 * finished - 2)  # steps whose every call has its result (never half)
    calls = [p["toolCallId"] for m in mine for p in m["parts"] if p["type"] == "tool-call"]
    results = [p["toolCallId"] for m in mine for p in m["parts"] if p["type"] == "tool-result"]
    assert calls and sorted(calls) == sorted(results)  # no orphaned tool call


# ----------------------------------------------------------------------------------------------- malformed payloads
@pytest.mark.parametrize("subject", ["ctx.persist.read_stream", "ctx.persist.append", "ctx.persist.history",
                                     "ctx.blob.put", "ctx.truncate.step", "ctx.compact.in_loop"])
async def test_malformed_requests_are_invalid_payload_not_internal(all_services, nats_broker, subject):
    bad = [b"[" * 60_000 + b"]" * 60_000, b'{"streamId":"conversation:\\ud800","fromVersion":1}',
           b'{"streamId":"s","fromVersion":' + b"9" * 30 + b"}"]
    for raw in bad:
        msg = await nats_broker.request(raw, subject, timeout=30)
        reply = json.loads(msg.body)
        assert reply["error"]["code"] == "invalid-payload", (subject, raw[:40], reply)
        assert "Traceback" not in reply["error"]["message"]


async def test_integers_beyond_the_database_are_invalid_payload(all_services, rpc):
    """Integers the contracts allow but Postgres cannot take (past int64, or past a column's type) are the
    caller's error: a typed answer (``invalid-payload``; an expected version no stream has is a conflict), or an
    empty page — never ``internal``."""
    from ctxbuild_platform.errors import RemoteError

    for subject, payload in (
            ("ctx.persist.read_stream", {"streamId": "conversation:none", "fromVersion": 10**30}),
            ("ctx.persist.read_stream", {"streamId": "conversation:none", "fromVersion": 2**40, "limit": 10**25}),
            ("ctx.persist.read_all", {"afterPosition": 10**30}),
            ("ctx.persist.append", {"streamId": "conversation:none", "expectedVersion": 10**30, "events": [
                {"eventId": str(uuid.uuid4()), "type": "TurnAbortRequested", "data": {"turnId": "t"}}]})):
        try:
            reply = await rpc.call(subject, payload)
        except RemoteError as exc:
            assert exc.code in ("invalid-payload", "version-conflict"), (subject, exc)  # typed, never internal
        else:
            assert reply.get("events", []) == [], (subject, reply)


# ----------------------------------------------------------------------------------------------- window fallback
def test_with_compaction_down_every_request_fits_the_window(stack, edge, runner, pages):
    """Compaction SIGKILLed: the runner fits every request to the window in-process (the room — the window minus
    the system prompt and tools — is recorded with each fallback) and says so in CompactionDecided. A turn start
    with nothing to fold never needed compaction (the runner plans it); one that must fold is fitted in-process."""
    window, n = 3000, 12
    cid = conversation(edge.url, "compaction away", contextWindow=window)
    stack.stop("compaction", sig=signal.SIGKILL)
    try:
        script = [{"toolCalls": [{"toolName": "web_fetch", "input": {"url": pages.url(f"big/{k}")}}]}
                  for k in range(1, n + 1)] + [{"text": "read them all"}]
        tid = start_turn(edge.url, cid, "read twelve long articles", script, max_steps=n + 1)
        evs = wait_for(edge.url, cid, tid, terminal)
        # the next turn starts on the twelve articles: over the trigger, a fold is needed and compaction is away
        tid2 = start_turn(edge.url, cid, "now sum them up", [{"text": "summed up"}])
        evs2 = wait_for(edge.url, cid, tid2, terminal)
    finally:
        stack.start_service("compaction")
    assert [e["type"] for e in terminal(evs)] == ["TurnCompleted"], terminal(evs)
    decided = {(e["data"]["phase"], e["data"].get("step")): e["data"] for e in evs if e["type"] == "CompactionDecided"}
    fallbacks = {k: d for k, d in decided.items() if str(d.get("fallback") or "").startswith("in-process")}
    first = decided[("turn-start", None)]  # one short message: planned by the runner, compaction not asked
    assert first["reason"] == "under-trigger" and not first.get("fallback"), first
    served = [e["data"] for e in evs if e["type"] == "StepServed"]
    assert len(served) == n + 1
    for s in served:
        d = fallbacks.get(("in-loop", s["step"]))
        if d is None:  # step 1 within the trigger: nothing to fold, the runner did not ask (runner.nothing_to_fold)
            assert s["step"] == 1 and s["servedTokens"] <= first["trigger"] < window, (s, first)
            continue
        assert s["servedTokens"] == d["postTokens"] <= d["room"] < window, (s["step"], d)
    over = [d for d in fallbacks.values() if d["phase"] == "in-loop" and d["preTokens"] > d["room"]]
    assert over, list(fallbacks.values())  # without the fallback, requests would have been over the window
    assert [e["type"] for e in terminal(evs2)] == ["TurnCompleted"], terminal(evs2)
    start = next(e["data"] for e in evs2 if e["type"] == "CompactionDecided" and e["data"]["phase"] == "turn-start")
    assert str(start.get("fallback") or "").startswith("in-process"), start
    assert start["preTokens"] > start["room"] >= start["postTokens"] and start["room"] < window, start
    served2 = [e["data"] for e in evs2 if e["type"] == "StepServed"]
    assert served2 and all(s["servedTokens"] < window for s in served2), served2
