"""Reads paged by bytes (SPEC §15.1) against the real persistence service, Postgres and NATS: a stream far larger
than one NATS message reads back whole through pages that each stay under the budget; history pages too, and a
turn start reads only the window from the deepest compaction boundary."""

from __future__ import annotations

import json

import pytest
from ctxbuild_platform.errors import RemoteError

from tests.support.persistence import append, event, new_id

pytestmark = pytest.mark.integration

BUDGET = 256 * 1024
BIG_EVENT_CHARS = 60_000  # under the 64 KiB event limit


@pytest.fixture(scope="module")
def persistence(start_service) -> str:
    return start_service("persistence")


def wire_size(reply: dict) -> int:
    return len(json.dumps(reply, ensure_ascii=False, separators=(",", ":")).encode())


async def fill_stream(rpc, stream: str, count: int) -> list[str]:
    ids = []
    for i in range(0, count, 10):
        batch = [event("Bulky", {"i": i + j, "text": f"{i + j:06d}" + "x" * BIG_EVENT_CHARS}) for j in range(10)]
        await append(rpc, stream, batch)
        ids += [e["eventId"] for e in batch]
    return ids


async def test_stream_over_5mb_reads_back_through_pages(persistence, rpc):
    stream = f"test:{new_id()}"
    ids = await fill_stream(rpc, stream, 100)  # ≈ 6 MB of events
    got, nxt, pages = [], 1, 0
    while True:
        page = await rpc.call("ctx.persist.read_stream", {"streamId": stream, "fromVersion": nxt})
        pages += 1
        assert page["events"], page
        assert wire_size(page) < BUDGET + 4096  # the events fit the default budget; the rest is the envelope
        got += page["events"]
        assert page["nextVersion"] == page["events"][-1]["version"] + 1
        if not page["more"]:
            break
        nxt = page["nextVersion"]
    assert [e["eventId"] for e in got] == ids and [e["version"] for e in got] == list(range(1, 101))
    assert got[57]["data"]["text"].startswith("000057") and pages >= 20
    assert page["lastVersion"] == 100

    small = await rpc.call("ctx.persist.read_stream", {"streamId": stream, "fromVersion": 3, "maxBytes": 1024})
    assert [e["version"] for e in small["events"]] == [3]  # one whole event even when it is over the budget
    assert small["more"] and small["nextVersion"] == 4
    counted = await rpc.call("ctx.persist.read_stream", {"streamId": stream, "limit": 2, "maxBytes": 1 << 20})
    assert [e["version"] for e in counted["events"]] == [1, 2] and counted["more"]
    tail = await rpc.call("ctx.persist.read_stream", {"streamId": stream, "fromVersion": 101})
    assert tail["events"] == [] and not tail["more"] and tail["nextVersion"] == 101


async def test_read_all_pages_by_bytes(persistence, rpc):
    start = (await rpc.call("ctx.persist.read_all", {"afterPosition": 0, "limit": 1}))
    head = start["lastPosition"]
    # the log's current head: page with tiny budgets from a known position instead of scanning everything
    while True:
        page = await rpc.call("ctx.persist.read_all", {"afterPosition": head, "limit": 10_000})
        head = page["nextPosition"]
        if not page["more"]:
            break
    stream = f"test:{new_id()}"
    ids = await fill_stream(rpc, stream, 90)  # ≈ 5.4 MB
    mine, cursor = [], head
    while True:
        page = await rpc.call("ctx.persist.read_all", {"afterPosition": cursor, "maxBytes": 200_000})
        assert page["events"] and wire_size(page) < 200_000 + 4096
        mine += [e["eventId"] for e in page["events"] if e["streamId"] == stream]
        assert page["nextPosition"] == page["events"][-1]["position"] != cursor
        cursor = page["nextPosition"]
        if not page["more"]:
            break
    assert mine == ids
    done = await rpc.call("ctx.persist.read_all", {"afterPosition": cursor})
    assert done["events"] == [] and not done["more"] and done["nextPosition"] == cursor


async def test_oversized_event_is_a_typed_refusal(persistence, rpc):
    stream = f"test:{new_id()}"
    with pytest.raises(RemoteError) as err:
        await append(rpc, stream, [event("Bulky", {"text": "y" * 70_000})])
    assert err.value.code == "invalid-payload" and "65536" in err.value.message
    assert (await rpc.call("ctx.persist.read_stream", {"streamId": stream}))["lastVersion"] == 0


# ---------------------------------------------------------------- history


@pytest.fixture(scope="module")
def blobstore(start_service) -> str:
    return start_service("blobstore")


def text_message(mid: str, role: str, text: str) -> dict:
    return {"id": mid, "role": role, "parts": [{"type": "text", "text": text}]}


async def long_conversation(rpc, n: int, boundary: int | None) -> str:
    """n messages of ~2 KB (user/assistant alternating), a compaction summary at message ``boundary``."""
    cid = new_id()
    stream = f"conversation:{cid}"
    await append(rpc, stream, [event("ConversationCreated", {"conversationId": cid})])
    for i in range(0, n, 20):
        batch = [event("UserMessageAdded", {"message": text_message(
            f"m{j:04d}", "user" if j % 2 == 0 else "assistant", f"{j:04d} " + "w" * 2000)})
            for j in range(i, min(i + 20, n))]
        await append(rpc, stream, batch)
    if boundary is not None:
        await append(rpc, stream, [event("CompactionSummaryRecorded",
                                         {"boundaryId": f"m{boundary:04d}", "summary": "what happened so far"})])
    return cid


async def test_history_pages_back_to_the_root(persistence, rpc):
    cid = await long_conversation(rpc, 200, None)  # ≈ 400 KB of messages
    pages, anchor = [], None
    while True:
        req = {"conversationId": cid, "maxBytes": 64 * 1024}
        if anchor:
            req["anchorId"] = anchor
        page = await rpc.call("ctx.persist.history", req)
        assert page["source"] == "projection" and page["messages"]
        assert wire_size({"messages": page["messages"]}) <= 64 * 1024
        pages.append(page)
        if not page["more"]:
            break
        assert page["start"] == "page"
        anchor = page["nextAnchorId"]
        assert anchor == page["messages"][0]["parentId"]
    assert pages[-1]["start"] == "root" and len(pages) >= 6
    ids = [m["id"] for p in reversed(pages) for m in p["messages"]]
    assert ids == [f"m{j:04d}" for j in range(200)]
    whole = await rpc.call("ctx.persist.history", {"conversationId": cid, "maxBytes": 1 << 20})
    assert len(whole["messages"]) == 200 and not whole["more"]  # capped at the service's maximum, still fits


async def test_turn_start_window_is_the_tail_from_the_boundary(persistence, rpc):
    cid = await long_conversation(rpc, 300, boundary=279)
    h = await rpc.call("ctx.persist.history", {"conversationId": cid, "window": "turn-start"})
    assert [m["id"] for m in h["messages"]] == [f"m{j:04d}" for j in range(279, 300)]
    assert h["start"] == "summary" and not h["more"] and h["clearedBefore"] is False
    assert h["messages"][0]["compactionSummary"] == "what happened so far"
    assert h["summaries"] == [{"boundaryId": "m0279", "index": 0}]
    # the same window folded from the events (projection bypassed) agrees
    stream_ids = [m["id"] for m in h["messages"]]
    limited = await rpc.call("ctx.persist.history", {"conversationId": cid, "maxMessages": 10})
    assert [m["id"] for m in limited["messages"]] == [f"m{j:04d}" for j in range(290, 300)]
    assert limited["start"] == "limit"
    assert stream_ids[-1] == limited["anchorId"] == "m0299"

    # a clear-context marker older than the boundary restricts; a newer one ends the window
    stream = f"conversation:{cid}"
    await append(rpc, stream, [event("UserMessageAdded", {"message": {**text_message("clr", "user", "/clear"),
                                                                      "clearContext": True}}),
                               event("UserMessageAdded", {"message": text_message("after", "user", "hi")})])
    h2 = await rpc.call("ctx.persist.history", {"conversationId": cid, "window": "turn-start"})
    assert [m["id"] for m in h2["messages"]] == ["clr", "after"] and h2["start"] == "clear"


async def test_a_clear_marker_before_the_boundary_is_reported(persistence, rpc):
    cid = new_id()
    stream = f"conversation:{cid}"
    msgs = [text_message("a", "user", "one"), {**text_message("c", "user", "/clear"), "clearContext": True},
            text_message("b", "assistant", "two"), text_message("d", "user", "three")]
    await append(rpc, stream, [event("ConversationCreated", {"conversationId": cid})]
                 + [event("UserMessageAdded", {"message": m}) for m in msgs]
                 + [event("CompactionSummaryRecorded", {"boundaryId": "b", "summary": "s"})])
    h = await rpc.call("ctx.persist.history", {"conversationId": cid, "window": "turn-start"})
    assert [m["id"] for m in h["messages"]] == ["b", "d"] and h["start"] == "summary" and h["clearedBefore"]


async def test_two_turns_of_700k_chars_stay_usable(persistence, blobstore, rpc):
    """A user message of 700,000 chars (parts by content reference, as the edge writes it) and an answer of
    700,000 chars through the persist lane: every stored event stays ≤ 64 KiB, history returns the real
    content, and the conversation takes new appends."""
    from ctxbuild_blobclient import BlobClient, content_ref

    blobs = BlobClient(rpc)
    cid = new_id()
    stream = f"conversation:{cid}"
    await append(rpc, stream, [event("ConversationCreated", {"conversationId": cid})])
    for turn in range(2):
        big = f"turn {turn} " + "".join(f"line {i} of a long paste\n" for i in range(30_000))[:700_000]
        user = text_message(f"u{turn}", "user", big)
        stored = await content_ref.store_message_parts(blobs, user, cid, ("conversation", cid), "tool_output")
        assert content_ref.is_ref(stored["parts"])
        await append(rpc, stream, [event("UserMessageAdded", {"message": stored})])
        answer = text_message(f"a{turn}", "assistant", "answer " + big[::-1])
        res = await rpc.call("ctx.persist.complete_turn", {
            "conversationId": cid, "turnId": f"t{turn}", "eventId": new_id(), "messages": [answer]})
        assert res["append"]["duplicates"] == 0
    page = await rpc.call("ctx.persist.read_stream", {"streamId": stream, "maxBytes": 1 << 20})
    assert not page["more"] and max(len(json.dumps(e["data"]).encode()) for e in page["events"]) <= 65_536

    got, anchor = [], None
    while True:  # one 700k message is over the page budget: each page holds one whole message
        req = {"conversationId": cid} | ({"anchorId": anchor} if anchor else {})
        h = await rpc.call("ctx.persist.history", req)
        got = h["messages"] + got
        if not h["more"]:
            break
        anchor = h["nextAnchorId"]
    assert [m["id"] for m in got] == ["u0", "a0", "u1", "a1"]
    assert got[2]["parts"][0]["text"].startswith("turn 1 ") and len(got[2]["parts"][0]["text"]) == 700_007
    assert got[3]["parts"][0]["text"] == "answer " + got[2]["parts"][0]["text"][::-1]
    await append(rpc, stream, [event("UserMessageAdded", {"message": text_message("u2", "user", "and now?")})])
    last = await rpc.call("ctx.persist.history", {"conversationId": cid, "maxBytes": 4096})
    assert [m["id"] for m in last["messages"]] == ["u2"] and last["more"] and last["nextAnchorId"] == "a1"
