"""No size ceiling (SPEC §15.1), end to end on the real stack: a conversation with 50+ turns and 100+ MB of tool
output stays usable — every turn completes, history, every served request and every read-back answer —, a 20 MB
MCP JSON output, a 5 MB `web_fetch` page, and an MCP image read back byte-identical.

The turns run on an edge and a runner replica of this module's own work-queue stream (the runner may fetch from
loopback, for the local page server); the MCP server is a real stdio server (tests/support/bulky_mcp_server.py).
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
import time
from pathlib import Path

import httpx
import pytest
from ctxbuild_devstack.replica import Replica
from ctxbuild_mcp_catalog.domain.tool_ids import tool_id

from tests.support.auth import AUTH
from tests.support.bulky_mcp_server import catalogue, png_bytes

pytestmark = pytest.mark.e2e

STREAM, SUBJECT, CONSUMER = "CTX_TURNS_NOCEIL", "ctx.turn.run_noceil_test", "noceil-runner"
BULKY = Path(__file__).resolve().parents[1] / "support" / "bulky_mcp_server.py"
TURNS = 50
OUTPUT_CHARS = 2_100_000  # per turn: 50 turns → 105 MB of tool output in one conversation
WINDOW = 32_000
PAGE_BYTES = 5_000_000


def big_output(turn: int) -> str:
    """A distinct ~2.1 MB log per turn (distinct, so content addressing cannot make the volume disappear)."""
    line = f"turn {turn:03d} build log: compiling module and linking objects, all steps green\n"
    return line * (OUTPUT_CHARS // len(line)) + f"END OF TURN {turn}\n"


def report_page() -> str:
    """One ~5 MB plain-text page."""
    line = "a very long field report with many observations and careful citations of sources\n"
    return line * (PAGE_BYTES // len(line))


@pytest.fixture(scope="module")
def pages(page_server):
    page_server.add("report", report_page(), "text/plain; charset=utf-8")
    return page_server


@pytest.fixture(scope="module")
def edge(stack, all_services):
    common = {"CTX_TURNS_STREAM": STREAM, "CTX_TURNS_SUBJECT": SUBJECT, "CTX_TURNS_CONSUMER": CONSUMER}
    e = Replica(stack, "orchestration", "noceil-edge", CTX_ROLE="edge", **common).wait_ready()
    r = Replica(stack, "orchestration", "noceil-runner", CTX_ROLE="runner", CTX_ALLOW_PRIVATE_NETWORKS="true",
                **common).wait_ready()
    yield e.url
    r.stop()
    e.stop()


def conversation(http: httpx.Client, **settings) -> str:
    r = http.post("/v1/conversations", json={"title": "no ceiling", "settings": {"contextWindow": WINDOW, **settings}})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def run_turn(http: httpx.Client, cid: str, text: str, script: list[dict], tools: list[dict] | None = None,
             timeout: float = 240) -> tuple[str, list[dict]]:
    provider = {"kind": "replay", "script": script, **({"tools": tools} if tools else {})}
    r = http.post(f"/v1/conversations/{cid}/turns", json={"text": text, "provider": provider})
    assert r.status_code == 202, r.text
    tid = r.json()["turnId"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = http.get(f"/v1/conversations/{cid}/turns/{tid}")
        assert log.status_code == 200, log.text
        events = log.json()["events"]
        ends = [e for e in events if e["type"] in ("TurnCompleted", "TurnFailed")]
        if ends:
            assert len(ends) == 1 and ends[0]["type"] == "TurnCompleted", ends
            return tid, events
        time.sleep(0.2)
    raise AssertionError(f"turn {tid} did not end")


def read_back(http: httpx.Client, cid: str, events: list[dict], call_id: str) -> dict:
    """The full output of a recorded tool call, through the UI read-back route of its persisted message."""
    msgs = http.get(f"/v1/conversations/{cid}/messages")
    assert msgs.status_code == 200, msgs.text
    tool_msg = next(m for m in msgs.json()["messages"] if m["role"] == "tool"
                    and any(p.get("toolCallId") == call_id for p in m["parts"]))
    r = http.get(f"/v1/conversations/{cid}/messages/{tool_msg['id']}/results/{call_id}")
    assert r.status_code == 200, r.text[:500]
    return r.json()


def recorded(events: list[dict]) -> list[dict]:
    return [e["data"] for e in events if e["type"] == "ToolResultRecorded"]


@pytest.mark.timeout(1200)
def test_fifty_turns_and_a_hundred_megabytes_stay_usable(edge):
    shell = [{"name": "shell", "description": "run a shell command", "inputSchema": {
        "type": "object", "properties": {"cmd": {"type": "string"}}}}]
    with httpx.Client(base_url=edge, headers=AUTH, timeout=120) as http:
        cid = conversation(http)
        turns: list[tuple[str, list[dict], str]] = []
        for k in range(1, TURNS + 1):
            out = big_output(k)
            script = [{"toolCalls": [{"toolName": "shell", "input": {"cmd": f"make build-{k}"},
                                      "output": {"type": "text", "value": out}}]},
                      {"text": f"build {k} is green"}]
            tid, events = run_turn(http, cid, f"run build {k} and tell me how it went", script, shell)
            turns.append((tid, events, hashlib.sha256(out.encode()).hexdigest()))
        total = sum(OUTPUT_CHARS for _ in turns)
        assert total >= 100_000_000

        hist = http.get(f"/v1/conversations/{cid}/messages")
        assert hist.status_code == 200, hist.text[:500]
        assert sum(1 for m in hist.json()["messages"] if m["role"] == "user") == TURNS
        for tid, events, digest in turns:
            served = [e["data"] for e in events if e["type"] == "StepServed"]
            assert [s["step"] for s in served] == [1, 2]
            for s in served:
                req = http.get(f"/v1/conversations/{cid}/turns/{tid}/steps/{s['step']}/request")
                assert req.status_code == 200, req.text[:300]
                assert hashlib.sha256(req.content).hexdigest() == s["requestHash"]
            (rec,) = recorded(events)
            assert rec["trimmed"], "a 2 MB output is over every threshold"
            full = read_back(http, cid, events, rec["toolCallId"])
            assert hashlib.sha256(full["output"]["value"].encode()).hexdigest() == digest

        # and the conversation still takes a new turn
        run_turn(http, cid, "summarise the builds", [{"text": "all fifty builds are green"}])


@pytest.fixture(scope="module")
def bulky() -> dict:
    return {"id": "bulky", "name": "bulky", "transport": "stdio", "command": sys.executable, "args": [str(BULKY)]}


async def _register(rpc, server: dict) -> None:
    reply = await rpc.call("ctx.mcp.servers.upsert", {"server": server})
    assert reply["server"]["id"] == server["id"]


@pytest.mark.timeout(600)
async def test_twenty_megabyte_mcp_json_and_an_image(edge, bulky, rpc):
    await _register(rpc, bulky)
    try:
        big, pic = tool_id("bulky", "big_json", "bulky"), tool_id("bulky", "picture", "bulky")
        with httpx.Client(base_url=edge, headers=AUTH, timeout=180) as http:
            cid = conversation(http, mcpServers=["bulky"])
            script = [{"toolCalls": [{"toolName": big, "input": {"megabytes": 20}}]},
                      {"toolCalls": [{"toolName": pic, "input": {"side": 256}}]},
                      {"text": "catalogue and picture received"}]
            _, events = run_turn(http, cid, "dump the catalogue and draw the picture", script, timeout=300)
            by_name = {r["toolName"]: r for r in recorded(events)}
            assert set(by_name) == {big, pic}, by_name.keys()

            dump = by_name[big]
            assert dump["trimmed"], "20 MB are over the threshold"
            assert len(json.dumps(dump)) < 65_536
            full = read_back(http, cid, events, dump["toolCallId"])["output"]
            assert full["type"] == "content"
            assert full["metadata"]["structuredContent"] == catalogue(20)
            assert json.loads(full["value"][0]["text"]) == catalogue(20)

            picture = read_back(http, cid, events, by_name[pic]["toolCallId"])["output"]
            image = next(b for b in picture["value"] if b["type"] == "image")
            assert image["mimeType"] == "image/png"
            assert base64.b64decode(image["data"]) == png_bytes(256)
    finally:
        await rpc.call("ctx.mcp.servers.remove", {"id": "bulky"})


def test_five_megabyte_web_page(edge, pages):
    with httpx.Client(base_url=edge, headers=AUTH, timeout=180) as http:
        cid = conversation(http)
        script = [{"toolCalls": [{"toolName": "web_fetch", "input": {"url": pages.url("report")}}]},
                  {"text": "read it"}]
        _, events = run_turn(http, cid, "read the field report", script)
        (rec,) = recorded(events)
        assert rec["trimmed"] and len(json.dumps(rec)) < 65_536
        full = read_back(http, cid, events, rec["toolCallId"])["output"]
        text = json.dumps(full)
        # the page body as web_fetch read it (cut at its byte cap at most), whole in the read-back
        assert text.count("a very long field report") >= (PAGE_BYTES // 90)


def test_an_answer_larger_than_any_event(edge):
    answer = "é" * 40_000  # 80 KB of JSON: over the 64 KiB an event may hold
    with httpx.Client(base_url=edge, timeout=120, headers=AUTH) as http:
        cid = conversation(http)
        _, events = run_turn(http, cid, "write it all out", [{"text": answer}])
        (done,) = [e for e in events if e["type"] == "TurnCompleted"]
        assert done["data"]["answer"] == answer  # the turn log presents it inline
        last = http.get(f"/v1/conversations/{cid}/messages").json()["messages"][-1]
        assert last["role"] == "assistant" and last["parts"] == [{"type": "text", "text": answer}]
