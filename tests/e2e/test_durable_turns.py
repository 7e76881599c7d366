"""Durable turns (issue #9 item 2) on the real stack: an edge and runner replicas as separate processes on their
own work-queue stream; a runner SIGKILLed mid-turn is replaced by another that resumes from the events — tool
results already recorded are not executed again (the tool is a real HTTP fetch, counted by the server), the turn
completes exactly once, and the conversation holds each message once with no orphaned tool call. Also: drain
hands a running turn back at once, abort, the step limit, regenerate (a sibling branch), the served request of
a step, and tool-result read-back."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections import Counter

import httpx
import pytest
from ctxbuild_devstack.replica import Replica
from ctxbuild_devstack.stack import free_port
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from tests.support.auth import AUTH
from tests.support.server import ThreadedServer, serving

pytestmark = pytest.mark.e2e

# the module's own stream (stream subjects may not overlap, hence its own subject too)
STREAM, SUBJECT, CONSUMER, ACK_WAIT = "CTX_TURNS_DURABLE", "ctx.turn.run_durable_test", "durable-runner", "3"


class SlowPages(ThreadedServer):
    """Each page answers after a delay and is counted: the tool with a visible side effect."""

    def __init__(self, port: int, delay_s: float = 0.6) -> None:
        self.delay_s = delay_s
        self.hits: Counter[str] = Counter()
        super().__init__(Starlette(routes=[Route("/{path:path}", self.page)]), port)

    async def page(self, request: Request) -> PlainTextResponse:
        self.hits[request.url.path] += 1
        if request.url.path.startswith("/big/"):  # one long article, far over a 16k window's threshold
            return PlainTextResponse("".join(f"paragraph {i}: " + "citation text " * 12 + "\n" for i in range(3000)))
        await asyncio.sleep(self.delay_s)
        return PlainTextResponse(f"page {request.url.path}\n" + "lorem ipsum dolor sit amet\n" * 40)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path}"


@pytest.fixture(scope="module")
def pages():
    yield from serving(SlowPages(free_port()))


def runner_env(**extra: str) -> dict[str, str]:
    return {"CTX_ROLE": "runner", "CTX_TURNS_STREAM": STREAM, "CTX_TURNS_SUBJECT": SUBJECT,
            "CTX_TURNS_CONSUMER": CONSUMER, "CTX_TURN_ACK_WAIT_S": ACK_WAIT, "CTX_ALLOW_PRIVATE_NETWORKS": "true",
            **extra}


@pytest.fixture(scope="module")
def edge(stack, all_services):
    """An edge-only replica on the test's own work-queue stream (so only this module's runners take its turns)."""
    e = Replica(stack, "orchestration", "orch-edge", CTX_ROLE="edge", CTX_TURNS_STREAM=STREAM,
                CTX_TURNS_SUBJECT=SUBJECT, CTX_TURNS_CONSUMER=CONSUMER, CTX_TURN_ACK_WAIT_S=ACK_WAIT).wait_ready()
    yield e
    e.stop()


@pytest.fixture
def runners(stack, edge):
    started: list[Replica] = []

    def start(name: str, **extra: str) -> Replica:
        r = Replica(stack, "orchestration", name, **runner_env(**extra)).wait_ready()
        started.append(r)
        return r

    yield start
    for r in started:
        r.stop()


def fetch_script(pages: SlowPages, tag: str, n: int) -> list[dict]:
    steps = [{"toolCalls": [{"toolName": "web_fetch", "input": {"url": pages.url(f"{tag}/{k}")}}]}
             for k in range(1, n + 1)]
    return [*steps, {"text": f"done reading {n} pages"}]


def events_of(base: str, cid: str, tid: str) -> list[dict]:
    return httpx.get(f"{base}/v1/conversations/{cid}/turns/{tid}", headers=AUTH, timeout=30).json()["events"]


def wait_for(base: str, cid: str, tid: str, pred, timeout: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        evs = events_of(base, cid, tid)
        if pred(evs):
            return evs
        time.sleep(0.1)
    raise AssertionError(f"condition not reached; events: {[e['type'] for e in events_of(base, cid, tid)]}")


def terminal(evs: list[dict]) -> list[dict]:
    return [e for e in evs if e["type"] in ("TurnCompleted", "TurnFailed")]


def new_turn(base: str, text: str, script: list[dict], **extra) -> tuple[str, str]:
    cid = httpx.post(f"{base}/v1/conversations", headers=AUTH, json={"title": text}, timeout=30).json()["id"]
    r = httpx.post(f"{base}/v1/conversations/{cid}/turns", headers=AUTH,
                   json={"text": text, "provider": {"kind": "replay", "script": script}, **extra}, timeout=30)
    assert r.status_code == 202, r.text
    return cid, r.json()["turnId"]


def assert_history_consistent(base: str, cid: str, turn_id: str, steps: int) -> None:
    """Each turn message once, every tool call answered by exactly one result, nothing orphaned."""
    msgs = httpx.get(f"{base}/v1/conversations/{cid}/messages", headers=AUTH, timeout=30).json()["messages"]
    mine = [m for m in msgs if m.get("turnId") == turn_id]
    ids = [m["id"] for m in mine]
    assert len(ids) == len(set(ids)) == 2 * steps - 1, [m["role"] for m in mine]
    calls = [p["toolCallId"] for m in mine for p in m["parts"] if p["type"] == "tool-call"]
    results = [p["toolCallId"] for m in mine for p in m["parts"] if p["type"] == "tool-result"]
    assert sorted(calls) == sorted(results) and len(calls) == len(set(calls)) == steps - 1


def test_sigkill_mid_turn_resumes_on_another_replica(edge, runners, pages):
    base = edge.url
    a = runners("orch-runner-a")
    cid, tid = new_turn(base, "read six pages", fetch_script(pages, "kill1", 6))
    # let it record two fetches, then kill the replica without warning
    before = wait_for(base, cid, tid, lambda evs: sum(e["type"] == "ToolResultRecorded" for e in evs) >= 2)
    a.kill()
    recorded_before = {e["data"]["toolCallId"] for e in events_of(base, cid, tid) if e["type"] == "ToolResultRecorded"}
    assert not terminal(before)
    runners("orch-runner-b")
    evs = wait_for(base, cid, tid, terminal, timeout=120)
    ends = terminal(evs)
    assert [e["type"] for e in ends] == ["TurnCompleted"], ends
    assert any(e["type"] == "TurnResumed" for e in evs)
    # recorded results were not executed again: each page fetched once, except at most the one in flight
    hits = {k: pages.hits[f"/kill1/{k}"] for k in range(1, 7)}
    assert all(v >= 1 for v in hits.values()), hits
    assert sum(v - 1 for v in hits.values()) <= 1, hits
    results = [e for e in evs if e["type"] == "ToolResultRecorded"]
    assert len(results) == len({e["data"]["toolCallId"] for e in results}) == 6
    for call_id in recorded_before:  # what was recorded before the kill was fetched exactly once
        k = int(call_id.rsplit("_", 2)[1])  # <prefix>_<step>_<i>; step k fetched page k
        assert hits[k] == 1, (call_id, hits)
    served = [e["data"]["step"] for e in evs if e["type"] == "StepServed"]
    assert served == sorted(set(served)) == list(range(1, 8))  # no model call asked twice
    assert_history_consistent(base, cid, tid, steps=7)


def test_repeated_kills_every_turn_completes_once(edge, runners, pages):
    """Three turns, the runner killed twice while they run: each completes exactly once."""
    base = edge.url
    turns = [new_turn(base, f"turn {i}", fetch_script(pages, f"multi{i}", 4)) for i in range(3)]
    for name in ("orch-runner-m1", "orch-runner-m2"):
        r = runners(name)
        cid, tid = turns[0]
        seen = len([e for e in events_of(base, cid, tid) if e["type"] == "ToolResultRecorded"])
        wait_for(base, cid, tid, lambda evs, s=seen: terminal(evs) or
                 sum(e["type"] == "ToolResultRecorded" for e in evs) > s)
        r.kill()
    runners("orch-runner-m3")
    for cid, tid in turns:
        evs = wait_for(base, cid, tid, terminal, timeout=180)
        assert [e["type"] for e in terminal(evs)] == ["TurnCompleted"]
        assert_history_consistent(base, cid, tid, steps=5)


def test_sigterm_hands_the_turn_back_at_once(edge, runners, pages):
    """Drain: a replica stopping gracefully NAKs its running turn; the next replica resumes it without waiting
    for the ack timeout, and the stopping replica exits 0."""
    base = edge.url
    a = runners("orch-runner-drain-a", CTX_DRAIN_TIMEOUT_S="0.5")
    cid, tid = new_turn(base, "drain me", fetch_script(pages, "drain", 5))
    wait_for(base, cid, tid, lambda evs: any(e["type"] == "ToolResultRecorded" for e in evs))
    assert a.stop() == 0
    runners("orch-runner-drain-b")
    evs = wait_for(base, cid, tid, terminal, timeout=120)
    assert [e["type"] for e in terminal(evs)] == ["TurnCompleted"]
    assert any(e["type"] == "TurnResumed" for e in evs)


def test_abort_ends_a_running_turn(edge, runners, pages):
    base = edge.url
    runners("orch-runner-abort")
    cid, tid = new_turn(base, "long one", fetch_script(pages, "abort", 8))
    wait_for(base, cid, tid, lambda evs: any(e["type"] == "ToolResultRecorded" for e in evs))
    r = httpx.post(f"{base}/v1/conversations/{cid}/turns/{tid}/abort", headers=AUTH,
                   json={"reason": "user pressed stop"}, timeout=30)
    assert r.status_code == 202, r.text
    evs = wait_for(base, cid, tid, terminal, timeout=60)
    end = terminal(evs)
    assert len(end) == 1 and end[0]["type"] == "TurnFailed" and end[0]["data"]["code"] == "aborted"
    assert "user pressed stop" in end[0]["data"]["message"]
    assert sum(pages.hits[f"/abort/{k}"] for k in range(1, 9)) < 8  # it really stopped
    again = httpx.post(f"{base}/v1/conversations/{cid}/turns/{tid}/abort", headers=AUTH, timeout=30)
    assert again.status_code == 409 and again.json()["code"] == "conflict"


def test_step_limit_is_a_clear_terminal_error(all_services, pages):
    base = all_services
    cid, tid = new_turn(base, "too many steps", [{"toolCalls": [{"toolName": "fs_read", "input": {"uri": "x"}}]}] * 5
                        + [{"text": "never"}], maxSteps=3)
    evs = wait_for(base, cid, tid, terminal)
    end = terminal(evs)[0]
    assert end["type"] == "TurnFailed" and end["data"]["code"] == "step-limit" and end["data"]["retryable"] is False
    assert "3 model calls" in end["data"]["message"]
    assert [e["data"]["step"] for e in evs if e["type"] == "StepServed"] == [1, 2, 3]
    # the work is kept: three answered calls join the conversation (a follow-up continues from them)
    msgs = httpx.get(f"{base}/v1/conversations/{cid}/messages", headers=AUTH, timeout=30).json()["messages"]
    assert [m["role"] for m in msgs if m.get("turnId") == tid] == ["assistant", "tool"] * 3
    too_many = httpx.post(f"{base}/v1/conversations/{cid}/turns", headers=AUTH, timeout=30, json={
        "text": "x", "maxSteps": 10_000, "provider": {"kind": "replay", "script": [{"text": "y"}]}})
    assert too_many.status_code == 422


def test_served_request_kept_inline_when_small_else_as_blob(all_services):
    """A small served request is kept in StepServed itself (no blob write beside the model call), a large one as a
    blob of the turn; GET …/steps/{n}/request returns the exact bytes either way."""
    base = all_services
    cid = httpx.post(f"{base}/v1/conversations", headers=AUTH, json={"settings": {"contextWindow": 200000}},
                     timeout=30).json()["id"]
    kept = {}
    for name, text in (("small", "hello"), ("large", "y" * 40_000)):
        r = httpx.post(f"{base}/v1/conversations/{cid}/turns", headers=AUTH, timeout=30,
                       json={"text": text, "provider": {"kind": "replay", "script": [{"text": "ok"}]}})
        tid = r.json()["turnId"]
        evs = wait_for(base, cid, tid, terminal)
        assert terminal(evs)[0]["type"] == "TurnCompleted", terminal(evs)
        served = next(e["data"] for e in evs if e["type"] == "StepServed")
        req = httpx.get(f"{base}/v1/conversations/{cid}/turns/{tid}/steps/1/request", headers=AUTH, timeout=30)
        assert req.status_code == 200
        assert hashlib.sha256(req.content).hexdigest() == served["requestHash"] == served["request"]["sha256"]
        assert len(req.content) == served["requestBytes"] == served["request"]["size"]
        kept[name] = (served["request"], req.content)
    small, small_bytes = kept["small"]
    assert small["body"].encode("utf-8") == small_bytes and len(small_bytes) < 16 * 1024
    large, large_bytes = kept["large"]
    assert "body" not in large and len(large_bytes) > 40_000


def test_served_request_regenerate_and_result_readback(all_services):
    base = all_services
    big = "\n".join(f"line {i}: " + "x" * 80 for i in range(4000))  # ~350 KB: trimmed in flight, offloaded
    cid = httpx.post(f"{base}/v1/conversations", headers=AUTH, json={"settings": {"contextWindow": 16000}},
                     timeout=30).json()["id"]
    att = httpx.post(f"{base}/v1/conversations/{cid}/attachments", headers=AUTH, timeout=60,
                     files={"file": ("big.txt", big.encode(), "text/plain")}).json()
    script = [{"toolCalls": [{"toolName": "read_file", "input": {"filename": att["handle"], "limit": 60000}}]},
              {"text": "first answer"}]
    r = httpx.post(f"{base}/v1/conversations/{cid}/turns", headers=AUTH, timeout=30,
                   json={"text": "read it", "provider": {"kind": "replay", "script": script}})
    tid = r.json()["turnId"]
    evs = wait_for(base, cid, tid, terminal)
    assert terminal(evs)[0]["type"] == "TurnCompleted", terminal(evs)

    # what the model saw on step 2, byte for byte: its sha256 is the recorded request hash
    served = {e["data"]["step"]: e["data"] for e in evs if e["type"] == "StepServed"}
    req = httpx.get(f"{base}/v1/conversations/{cid}/turns/{tid}/steps/2/request", headers=AUTH, timeout=30)
    assert req.status_code == 200
    assert hashlib.sha256(req.content).hexdigest() == served[2]["requestHash"] == req.headers["x-request-hash"]
    body = req.json()
    assert body["messages"][-1]["role"] == "tool" and "<persisted-output>" in json.dumps(body["messages"][-1])
    # a prefix-stable turn: step 2's request extends step 1's
    req1 = httpx.get(f"{base}/v1/conversations/{cid}/turns/{tid}/steps/1/request", headers=AUTH, timeout=30).json()
    assert body["messages"][:len(req1["messages"])] == req1["messages"]
    assert httpx.get(f"{base}/v1/conversations/{cid}/turns/{tid}/steps/9/request", headers=AUTH,
                     timeout=30).status_code == 404

    # the trimmed read_file output reads back in full
    recorded = next(e["data"] for e in evs if e["type"] == "ToolResultRecorded")
    assert recorded["trimmed"]
    tool_msg = next(m for m in httpx.get(f"{base}/v1/conversations/{cid}/messages", headers=AUTH,
                                         timeout=30).json()["messages"]
                    if m["role"] == "tool")
    full = httpx.get(f"{base}/v1/conversations/{cid}/messages/{tool_msg['id']}/results/{recorded['toolCallId']}",
                     headers=AUTH, timeout=60)
    assert full.status_code == 200, full.text
    out = full.json()["output"]
    text = out["value"] if isinstance(out["value"], str) else json.dumps(out["value"])
    assert big[:60000] in text or big[:5000] in text

    # regenerate: a new turn over the same user message; its answer is a sibling of the first
    rg = httpx.post(f"{base}/v1/conversations/{cid}/turns/{tid}/regenerate", headers=AUTH, timeout=30,
                    json={"provider": {"kind": "replay", "script": [{"text": "second answer"}]}})
    assert rg.status_code == 202, rg.text
    tid2 = rg.json()["turnId"]
    assert rg.json()["userMessageId"] == r.json()["userMessageId"]
    wait_for(base, cid, tid2, terminal)
    hist = httpx.get(f"{base}/v1/conversations/{cid}/messages", headers=AUTH, params={"branches": "true"},
                     timeout=30).json()
    path = hist["messages"]
    assert path[-1]["role"] == "assistant" and path[-1]["parts"][0]["text"] == "second answer"
    user = r.json()["userMessageId"]
    assert path[-2]["id"] == user
    siblings = hist["branches"][path[-1]["id"]]
    assert len(siblings) == 2  # the first answer's branch is still there
    first = next(s for s in siblings if s != path[-1]["id"])
    old_branch = httpx.get(f"{base}/v1/conversations/{cid}/messages", headers=AUTH, params={"anchor": first},
                           timeout=30).json()
    assert old_branch["messages"][-1]["role"] == "assistant" and old_branch["messages"][-1]["turnId"] == tid
    # a finished turn whose events were all seen: the stream says so at once instead of idling
    last = evs[-1]["version"]
    done = httpx.get(f"{base}/v1/conversations/{cid}/turns/{tid}/events", headers={**AUTH, "Last-Event-ID": str(last)},
                     timeout=10)
    assert done.status_code == 204
    unknown = httpx.post(f"{base}/v1/conversations/{cid}/turns/turn_nope/regenerate", headers=AUTH, timeout=30)
    assert unknown.status_code == 404


async def test_web_result_entities_stay_referenced_after_the_turn(edge, runners, pages, pg):
    """A fetched page trimmed in flight (entities codec: one blob per trimmed entity) keeps a tool_output reference
    of its message after the turn released its provisional references, and reads back whole."""
    base = edge.url
    runners("orch-runner-web")
    cid = httpx.post(f"{base}/v1/conversations", headers=AUTH, json={"settings": {"contextWindow": 16000}},
                     timeout=30).json()["id"]
    script = [{"toolCalls": [{"toolName": "web_fetch", "input": {"url": pages.url("big/article")}}]}, {"text": "ok"}]
    r = httpx.post(f"{base}/v1/conversations/{cid}/turns", headers=AUTH, timeout=30,
                   json={"text": "fetch", "provider": {"kind": "replay", "script": script}})
    tid = r.json()["turnId"]
    evs = wait_for(base, cid, tid, terminal)
    assert terminal(evs)[0]["type"] == "TurnCompleted", terminal(evs)
    rec = next(e["data"] for e in evs if e["type"] == "ToolResultRecorded")
    assert rec["trimmed"] and rec["offload"]["blobs"], rec.get("offload")
    item = rec["output"]["value"][0]
    assert item["url"] == pages.url("big/article") and item["id"] and "<persisted-output>" in item["content"]
    shas = [b["sha256"] for b in rec["offload"]["blobs"]]
    tool_msg = next(m for m in httpx.get(f"{base}/v1/conversations/{cid}/messages", headers=AUTH,
                                         timeout=30).json()["messages"]
                    if m["role"] == "tool")
    # the runner releases the turn's provisional references right after its closing commit (beside the end
    # notice, not before it): the released state is waited for, the message's own reference is there already
    rows = await pg.fetch("SELECT sha256, owner_kind, owner_id, role FROM blobstore.refs WHERE sha256 = ANY($1)", shas)
    assert ("message", "tool_output") in {(r["owner_kind"], r["role"]) for r in rows}, rows
    for _ in range(300):
        rows = await pg.fetch("SELECT sha256, owner_kind, owner_id, role FROM blobstore.refs WHERE sha256 = ANY($1)",
                              shas)
        if ("turn", "provisional") not in {(r["owner_kind"], r["role"]) for r in rows}:
            break
        await asyncio.sleep(0.1)
    by_role = {(r["owner_kind"], r["role"]) for r in rows}
    assert ("message", "tool_output") in by_role and ("turn", "provisional") not in by_role, rows
    assert {r["owner_id"] for r in rows if r["role"] == "tool_output"} == {tool_msg["id"]}
    full = httpx.get(f"{base}/v1/conversations/{cid}/messages/{tool_msg['id']}/results/{rec['toolCallId']}",
                     headers=AUTH, timeout=60).json()
    assert full["source"] in ("offloaded", "persisted")
    content = full["output"]["value"][0]["content"]
    assert content.startswith("paragraph 0: ") and content.rstrip().endswith("citation text") and len(content) > 100_000


async def test_an_abort_whose_wake_up_was_missed_still_ends_the_turn(edge, runners, pages, rpc):
    """Only the durable half of an abort (the event, no ctx.turn.abort broadcast): the runner's next write meets
    it as a version conflict and ends the turn as aborted, not as a take-over."""
    base = edge.url
    runners("orch-runner-abort-quiet")
    cid, tid = new_turn(base, "long quiet one", fetch_script(pages, "quiet", 8))
    wait_for(base, cid, tid, lambda evs: any(e["type"] == "ToolResultRecorded" for e in evs))
    await rpc.call("ctx.persist.append", {"streamId": f"turn:{tid}", "expectedVersion": None, "events": [
        {"eventId": str(uuid.uuid4()), "type": "TurnAbortRequested", "data": {"turnId": tid, "reason": "quiet stop"}}]})
    evs = wait_for(base, cid, tid, terminal, timeout=60)
    end = terminal(evs)
    assert len(end) == 1 and end[0]["data"]["code"] == "aborted" and "quiet stop" in end[0]["data"]["message"]
    assert sum(pages.hits[f"/quiet/{k}"] for k in range(1, 9)) < 8
