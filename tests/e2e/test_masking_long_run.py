"""Masking on a long run (issue #14, SPEC §15.1 "events stay small"): the real mini-swe-agent trajectory (80
model calls, tool outputs up to ~110 KB) replayed through the whole stack with the masking summarizer and a 32k
window. Each in-loop fold records its checkpoint by reference, so the turn stream stays small: the turn log and
every step's served request answer, and the largest stored event of the conversation is under 64 KiB."""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from ctxbuild_blobclient import content_ref
from ctxbuild_providers.trajectories import load_trajectory

from tests.support.auth import AUTH

pytestmark = pytest.mark.e2e

MINI = Path(__file__).resolve().parents[3] / "shared" / "data" / "trajectories" / \
    "03_miniswe_deepseek-chat_sqlfluff-1733.traj.json"
WINDOW = 32_000
EVENT_MAX_BYTES = 65_536
TERMINAL = ("TurnCompleted", "TurnFailed")


async def until_terminal(http: httpx.AsyncClient, cid: str, tid: str) -> dict:
    """Poll the turn log (the endpoint under test) until the turn has ended."""
    while True:
        r = await http.get(f"/v1/conversations/{cid}/turns/{tid}")
        assert r.status_code == 200, r.text[:500]
        log = r.json()
        if log["status"] in ("completed", "failed"):
            return log
        await asyncio.sleep(1.0)


@dataclass
class Run:
    cid: str
    tid: str
    log: dict
    steps: int
    events: list[dict] = field(default_factory=list)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def run(all_services) -> Run:
    """One replay of the whole trajectory (about a minute on the stack), shared by the checks below."""
    if not MINI.exists():
        pytest.skip(f"trajectory not available: {MINI}")
    traj = load_trajectory(MINI)
    steps = len(traj.turns[0].script)
    async with httpx.AsyncClient(base_url=all_services, headers=AUTH, timeout=60) as http:
        r = await http.post("/v1/conversations", json={"title": "mini-swe masking", "settings": {
            "contextWindow": WINDOW, "summarizer": "masking"}})
        cid = r.json()["id"]
        r = await http.post(f"/v1/conversations/{cid}/turns", json={
            "text": traj.turns[0].text, "provider": traj.replay_spec(0), "maxSteps": steps})
        assert r.status_code == 202, r.text
        tid = r.json()["turnId"]
        log = await asyncio.wait_for(until_terminal(http, cid, tid), 200)
    return Run(cid, tid, log, steps, log["events"])


async def largest_events(pg, *streams: str) -> list[dict]:
    rows = await pg.fetch(
        "SELECT stream_id, type, octet_length(data::text) + octet_length(coalesce(metadata::text, '')) AS bytes "
        "FROM persistence.events WHERE stream_id = ANY($1) ORDER BY bytes DESC LIMIT 3", list(streams))
    return [dict(r) for r in rows]


@pytest.mark.timeout(240)
async def test_every_step_is_served_readable_and_the_turn_stream_stays_small(run, all_services, pg):
    events = run.events
    # masking folded in the loop, and the checkpoints went by reference once they were large
    folds = [e["data"] for e in events if e["type"] == "InLoopFoldRecorded"]
    decided = [e["data"] for e in events if e["type"] == "CompactionDecided" and e["data"]["phase"] == "in-loop"]
    assert folds and all(d["summarizer"] == "masking" for d in decided if d["status"] == "done"), decided
    assert any(content_ref.is_ref(f["compactedPrefix"]) for f in folds)

    # every step's served request answers: the exact bytes the model saw, within the window
    served = [e["data"] for e in events if e["type"] == "StepServed"]
    assert [s["step"] for s in served] == list(range(1, run.steps + 1))
    async with httpx.AsyncClient(base_url=all_services, headers=AUTH, timeout=60) as http:
        for s in served:
            r = await http.get(f"/v1/conversations/{run.cid}/turns/{run.tid}/steps/{s['step']}/request")
            assert r.status_code == 200, (s["step"], r.text[:300])
            assert hashlib.sha256(r.content).hexdigest() == s["requestHash"] == r.headers["x-request-hash"]
            assert s["servedTokens"] <= WINDOW, s
    # the turn log shows assistant parts and tool outputs inline (a referenced one is resolved for it)
    results = [e["data"] for e in events if e["type"] == "ToolResultRecorded"]
    assert len(results) == run.steps - 1 and all(r["output"]["type"] in ("text", "error-text") for r in results)
    assert all(isinstance(s["assistantMessage"]["parts"], list) for s in served)

    sizes = await largest_events(pg, f"turn:{run.tid}")
    assert sizes[0]["bytes"] <= EVENT_MAX_BYTES, sizes
    total = await pg.fetchval("SELECT sum(octet_length(data::text)) FROM persistence.events WHERE stream_id = $1",
                              f"turn:{run.tid}")
    print(json.dumps({"steps": len(served), "folds": len(folds), "largestTurnEvent": sizes[0],
                      "turnStreamBytes": total}))


@pytest.mark.timeout(240)
async def test_the_turn_completes_and_every_stored_event_is_under_64_kib(run, pg):
    """The conversation stream too: the persist lane's AssistantMessageCompleted holds the 80 steps by reference."""
    assert run.log["status"] == "completed", run.log.get("error")
    sizes = await largest_events(pg, f"turn:{run.tid}", f"conversation:{run.cid}")
    assert sizes[0]["bytes"] <= EVENT_MAX_BYTES, sizes
