"""Lossless compaction end to end (SPEC §15.2, issue #17) through the six services under a 6k window: one long
replayed turn reads the 20-page log page by page, so in-loop compaction folds at least three times. Every served
request (``GET …/steps/{n}/request``, the bytes the model saw) holds the turn's task verbatim as a user message at
the same position once folding started, and every tool output a fold took away is read back in full through the
transcript URIs the summary row names — paged with fs_read, and found with fs_read's pattern — with the turn's
own restricted read scope (the model's view)."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from ctxbuild_orchestration.demo import PAGE, generate_log
from httpx_sse import aconnect_sse

from tests.support.auth import AUTH

pytestmark = pytest.mark.e2e

WINDOW = 6_000
PAGES = 20
TASK = "Read service.log page by page and tell me which line reports an ERROR."
TRANSCRIPT_LINE = "[The full transcript of the folded part is readable via the fs_read tool at: "
LINE_NO = re.compile(r"^ *\d+\t")


def of(events: list[dict], type_: str) -> list[dict]:
    return [e["data"] for e in events if e["type"] == type_]


async def replay(all_services, summarizer: str) -> dict:
    async with httpx.AsyncClient(base_url=all_services, headers=AUTH, timeout=60) as http:
        cid = (await http.post("/v1/conversations", json={
            "title": "lossless", "settings": {"contextWindow": WINDOW, "mcpMode": "disabled",
                                              "summarizer": summarizer}})).json()["id"]
        att = await http.post(f"/v1/conversations/{cid}/attachments",
                              files={"file": ("service.log", generate_log().encode(), "text/plain")})
        assert att.status_code == 201
        script = [{"toolCalls": [{"toolName": "read_file", "input": {"filename": "service.log",
                                                                      "offset": (p - 1) * PAGE, "limit": PAGE}}]}
                  for p in range(1, PAGES + 1)] + [{"text": "One page has the ERROR line."}]
        started = (await http.post(f"/v1/conversations/{cid}/turns", json={
            "text": TASK, "provider": {"kind": "replay", "script": script}, "maxSteps": PAGES + 1})).json()
        async with aconnect_sse(http, "GET", started["events"]) as sse:
            async for ev in sse.aiter_sse():
                if ev.event in ("TurnCompleted", "TurnFailed"):
                    assert ev.event == "TurnCompleted", json.loads(ev.data)
                    break
        tid = started["turnId"]
        events = (await http.get(f"/v1/conversations/{cid}/turns/{tid}")).json()["events"]
        requests = []
        for s in of(events, "StepServed"):
            r = await http.get(f"/v1/conversations/{cid}/turns/{tid}/steps/{s['step']}/request")
            assert r.status_code == 200, r.text[:300]
            requests.append(r.json())
        # every tool output in full, as the UI reads it back (offloaded ones from their blobs)
        full = {}
        for m in (await http.get(f"/v1/conversations/{cid}/messages")).json()["messages"]:
            for p in m["parts"]:
                if p["type"] == "tool-result":
                    back = await http.get(f"/v1/conversations/{cid}/messages/{m['id']}/results/{p['toolCallId']}")
                    assert back.status_code == 200, back.text[:300]
                    full[p["toolCallId"]] = back.json()["output"]["value"]
        assert len(full) == PAGES
    return {"cid": cid, "tid": tid, "events": events, "requests": requests, "full": full}


@pytest.fixture(scope="module")
async def turn(all_services):
    return await replay(all_services, "extractive")


@pytest.fixture(scope="module")
async def masked(all_services):
    return await replay(all_services, "masking")


def task_rows(body: dict) -> list[dict]:
    return [m for m in body["messages"] if m["role"] == "user"
            and [p.get("text") for p in m["parts"] if p["type"] == "text"] == [TASK]]


async def test_the_task_survives_three_folds_verbatim_in_every_request(turn):
    folds = [d for d in of(turn["events"], "CompactionDecided") if d["phase"] == "in-loop" and d["status"] == "done"]
    assert len(folds) >= 3, folds
    requests = turn["requests"]
    assert len(requests) == PAGES + 1
    first_task = task_rows(requests[0])
    assert len(first_task) == 1
    for n, body in enumerate(requests, start=1):
        assert task_rows(body) == first_task, n   # verbatim: the same row, byte for byte
    # once folding started: [task, summary row, kept…] — the task at a byte-stable position
    folded = [b for b in requests if any(m["id"].startswith("compaction:") for m in b["messages"])]
    assert len(folded) >= 3
    for body in folded:
        assert body["messages"][0] == first_task[0]
        assert body["messages"][1]["id"].startswith("compaction:")


async def fs_read(rpc, turn, uri, scoped=True, **args) -> dict:
    """A read as the model's fs_read makes it: the turn's id and a retained context (here: nothing retained
    beyond what the turn itself references); ``scoped=False``: conversation-wide (what the UI read-back sees)."""
    scope = {"turnId": turn["tid"], "retained": {"fileAttachments": [], "persistedUris": []}} if scoped else {}
    return await rpc.call("ctx.blob.fs_read", {"conversationId": turn["cid"], "uri": uri, **scope, **args})


async def read_all(rpc, turn, uri, scoped=True) -> str:
    """The whole blob through fs_read pages (a line cut at a page continues by column)."""
    lines, offset, column = [], 1, 1
    while True:
        r = await fs_read(rpc, turn, uri, scoped, offset=offset, column=column)
        assert r["kind"] == "text", r
        rendered = r["text"].split("\n") if r["text"] else []
        for k, ln in enumerate(rendered):
            body = LINE_NO.sub("", ln, count=1)
            if k == 0 and column > 1:
                lines[-1] += body
            else:
                lines.append(body)
        if "nextColumn" in r:
            offset, column = r["endLine"], r["nextColumn"]
        elif r["endLine"] < r["totalLines"]:
            offset, column = r["endLine"] + 1, 1
        else:
            return "\n".join(lines) + "\n"


async def test_every_folded_output_reads_back_through_the_summary_transcripts(turn, rpc):
    last = turn["requests"][-1]
    row = last["messages"][1]["parts"][0]["text"]
    line = next(p for p in row.split("\n\n") if p.startswith(TRANSCRIPT_LINE))
    uris = line[len(TRANSCRIPT_LINE):-1].split(", ")
    folds = [d for d in of(turn["events"], "CompactionDecided") if d["phase"] == "in-loop" and d["status"] == "done"]
    assert len(uris) == len(folds) >= 3
    archived = [await read_all(rpc, turn, u) for u in uris]
    served = json.dumps(last, ensure_ascii=False, separators=(",", ":"))
    folded_away = [cid for cid in turn["full"] if f'"toolCallId":"{cid}"' not in served]
    assert len(folded_away) >= PAGES // 2
    for call_id in folded_away:
        text = turn["full"][call_id]
        assert any(text in a for a in archived), call_id   # in full, in a transcript the request names
    # the model can search instead of paging: the one ERROR line, found by a pattern, numbered
    error_line = next(ln for ln in generate_log().splitlines() if " ERROR " in ln)
    hits = [await fs_read(rpc, turn, u, pattern=r"\bERROR\b.*exceeded") for u in uris]
    found = [h for h in hits if h["kind"] == "text" and h["matches"]]
    assert found and error_line in found[0]["text"]
    assert all(LINE_NO.match(ln) for ln in found[0]["text"].split("\n"))
    # a bad pattern is a result the model reads, not a failure
    bad = await fs_read(rpc, turn, uris[0], pattern="(unclosed")
    assert bad["kind"] == "error" and bad["code"] == "invalid-pattern"


URI = re.compile(r"context://vfs/vfs_[0-9a-f]{16}\.txt")


async def test_masking_keeps_the_task_and_every_output_one_link_away(masked, rpc):
    """Masking: the task stays verbatim where it was in every request, every request fits the window, and at the
    last step every output of the run is in the request or behind a link in it (a masked output's own blob, or
    the transcript of a collapse)."""
    folds = [d for d in of(masked["events"], "CompactionDecided") if d["phase"] == "in-loop" and d["status"] == "done"]
    assert folds and all(d["summarizer"] == "masking" for d in folds)
    requests = masked["requests"]
    first_task = task_rows(requests[0])
    assert len(first_task) == 1
    at = requests[0]["messages"].index(first_task[0])
    for body in requests:
        assert task_rows(body) == first_task and body["messages"][at] == first_task[0]
    assert all(s["servedTokens"] <= WINDOW for s in of(masked["events"], "StepServed"))
    last = requests[-1]
    served = [p["output"]["value"] for m in last["messages"] for p in m["parts"]
              if p["type"] == "tool-result" and isinstance(p["output"].get("value"), str)]
    uris = list(dict.fromkeys(URI.findall(json.dumps(last, ensure_ascii=False))))
    # after the turn: the in-flight offloads are the conversation's now (the persist lane's references), so the
    # links are read conversation-wide
    linked = [await read_all(rpc, masked, u, scoped=False) for u in uris]
    masked_away = 0
    for call_id, text in masked["full"].items():
        if any(text in v for v in served):
            continue
        masked_away += 1
        assert any(text in b for b in linked), call_id
    assert masked_away >= PAGES // 2


async def run_turn(http, cid: str, text: str, script: list[dict]) -> str:
    started = (await http.post(f"/v1/conversations/{cid}/turns", json={
        "text": text, "provider": {"kind": "replay", "script": script}, "maxSteps": len(script)})).json()
    async with aconnect_sse(http, "GET", started["events"]) as sse:
        async for ev in sse.aiter_sse():
            if ev.event in ("TurnCompleted", "TurnFailed"):
                assert ev.event == "TurnCompleted", json.loads(ev.data)
                break
    return started["turnId"]


async def test_a_folded_output_quoted_by_a_stored_summary_reads_back_in_full(turn, all_services):
    """The next turn starts with a turn-start fold over the first turn's rows and stores its summary; the turn
    after serves from that summary's boundary. The summary quotes folded markers' ``Full output`` links; the
    model's fs_read of such a link (with that turn's retained context) answers the output in full — a fold
    revokes nothing (SPEC §6, §15.2): the fold transcript's members stay readable."""
    cid = turn["cid"]
    async with httpx.AsyncClient(base_url=all_services, headers=AUTH, timeout=60) as http:
        stored = (await http.get(f"/v1/conversations/{cid}/messages")).json()["messages"]
        linked = {}   # an archived output's URI → its tool call
        for m in stored:
            for p in m["parts"]:
                if p["type"] == "tool-result":
                    for u in URI.findall(json.dumps(p, ensure_ascii=False)):
                        linked.setdefault(u, p["toolCallId"])
        assert len(linked) >= 3, linked
        folding = await run_turn(http, cid, "Thanks.", [{"text": "noted"}])
        fold = next(d for d in of((await http.get(f"/v1/conversations/{cid}/turns/{folding}")).json()["events"],
                                  "CompactionDecided") if d["phase"] == "turn-start")
        assert fold["status"] == "done", fold
        reads = list(linked)   # every one: the summary quotes some, the others are one transcript away
        tid = await run_turn(http, cid, "Show me the pages again.", [
            {"toolCalls": [{"toolName": "fs_read", "input": {"uri": u}} for u in reads]}, {"text": "ok"}])
        events = (await http.get(f"/v1/conversations/{cid}/turns/{tid}")).json()["events"]
        first = (await http.get(f"/v1/conversations/{cid}/turns/{tid}/steps/1/request")).json()
        messages = (await http.get(f"/v1/conversations/{cid}/messages")).json()["messages"]
    start = next(d for d in of(events, "CompactionDecided") if d["phase"] == "turn-start")
    assert start["status"] != "done", start   # served from the stored summary's boundary, no second fold
    summary = next(m for m in first["messages"] if m["id"].startswith("compaction:"))
    summary_text = json.dumps(summary, ensure_ascii=False)
    served_calls = {p["toolCallId"] for m in first["messages"] for p in m["parts"] if p["type"] == "tool-result"}
    quoted = [u for u in reads if linked[u] not in served_calls and u in summary_text]
    assert quoted, summary_text[:2000]
    own = {p["toolCallId"]: p["output"] for m in messages if m.get("turnId") == tid for p in m["parts"]
           if p["type"] == "tool-result"} or {p["toolCallId"]: p["output"] for m in messages for p in m["parts"]
                                              if p["type"] == "tool-result" and p["toolCallId"] not in turn["full"]}
    answered = [json.dumps(o, ensure_ascii=False) for o in own.values()]
    assert len(answered) == len(reads), own
    assert not any("not-found" in a for a in answered), [a[:300] for a in answered if "not-found" in a]
    for u in reads:
        original = turn["full"][linked[u]]
        probe = next(ln for ln in original.splitlines()[1:] if len(ln) > 20)   # a line of the output's body
        assert any(json.dumps(probe, ensure_ascii=False)[1:-1] in a for a in answered), u
