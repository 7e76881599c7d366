"""Byte paging of history and small AssistantMessageCompleted events, as pure logic (the SQL twin is tested on
Postgres in tests/integration/test_persistence_paging.py)."""

from __future__ import annotations

import json
import uuid

from ctxbuild_codec.turn_start import TurnStartSettings, merge_pages, plan_turn_start
from ctxbuild_persistence.app.persist_lane import completed_events
from ctxbuild_persistence.domain.conversation import PathWindow, fold, message_bytes, path_to, window_of

URI = "context://vfs/vfs_{:016x}.txt"


def msg(mid: str, role: str = "user", size: int = 100, **extra) -> dict:
    return {"id": mid, "role": role, "parts": [{"type": "text", "text": "x" * size}], **extra}


def path(n: int, size: int = 100) -> list[dict]:
    events = [{"type": "UserMessageAdded", "data": {"message": msg(f"m{i}", "user" if i % 2 == 0 else "assistant",
                                                                   size)}} for i in range(n)]
    return path_to(fold("c", events))


def test_a_page_holds_whole_messages_within_the_budget():
    p = path(10)
    one = message_bytes(p[5])
    page, start, _ = window_of(p, PathWindow(max_bytes=3 * one + 5))
    assert [m["id"] for m in page] == ["m7", "m8", "m9"] and start == "page"
    assert page[0]["parentId"] == "m6"  # where the next page continues
    page, start, _ = window_of(p, PathWindow(max_bytes=10))
    assert [m["id"] for m in page] == ["m9"] and start == "page"  # at least one, even over the budget
    page, start, _ = window_of(p, PathWindow(max_bytes=1 << 30))
    assert len(page) == 10 and start == "root"


def test_a_reference_counts_at_its_resolved_size():
    ref = {"contentRef": {"uri": URI.format(1), "sha256": "0" * 64, "size": 700_000,
                          "mediaType": "application/json"}}
    assert message_bytes({"id": "u", "role": "user", "parts": ref}) > 700_000


def test_turn_start_window_stops_at_the_deepest_boundary_or_a_clear_marker():
    p = path(10)
    p[3]["compactionSummary"] = "old"
    p[6]["compactionSummary"] = "newer"
    page, start, cleared = window_of(p, PathWindow(1 << 30, stop_at_summary=True))
    assert [m["id"] for m in page] == ["m6", "m7", "m8", "m9"] and start == "summary" and not cleared
    p[1]["clearContext"] = True
    assert window_of(p, PathWindow(1 << 30, stop_at_summary=True))[2] is True  # a marker before the boundary
    p[8]["clearContext"] = True
    page, start, _ = window_of(p, PathWindow(1 << 30, stop_at_summary=True))
    assert [m["id"] for m in page] == ["m8", "m9"] and start == "clear"


def test_max_messages_window_extends_back_to_a_user_row():
    page, start, _ = window_of(path(10), PathWindow(1 << 30, max_messages=3))
    assert [m["id"] for m in page] == ["m6", "m7", "m8", "m9"] and start == "limit"  # m7 is an assistant row


def test_large_turns_are_spread_over_small_events():
    messages = [msg(f"t{i}", "tool", 10_000) for i in range(30)]
    eid = str(uuid.uuid4())
    events = completed_events({"eventId": eid, "turnId": "t", "usage": {"inputTokens": 1}}, messages, 48 * 1024)
    assert len(events) > 1 and events[0]["eventId"] == eid
    assert len({e["eventId"] for e in events}) == len(events)
    assert [m["id"] for e in events for m in e["data"]["messages"]] == [m["id"] for m in messages]
    assert all(len(json.dumps(e["data"]).encode()) <= 48 * 1024 + 200 for e in events)
    assert "usage" in events[-1]["data"] and all("usage" not in e["data"] for e in events[:-1])
    again = completed_events({"eventId": eid, "turnId": "t"}, messages, 48 * 1024)
    assert [e["eventId"] for e in again] == [e["eventId"] for e in events]  # a retry appends the same ids


def test_pages_merge_oldest_first_with_the_newest_head():
    newest = {"conversationId": "c", "version": 9, "messages": [msg("m2"), msg("m3")], "attachments": [],
              "anchorId": "m3", "lastUsage": None, "summaries": [], "persistedUris": [URI.format(2)],
              "start": "page", "more": True, "nextAnchorId": "m1"}
    older = {"conversationId": "c", "version": 9, "messages": [msg("m0", compactionSummary="s"), msg("m1")],
             "attachments": [], "anchorId": "m1", "lastUsage": {"messageId": "m1", "usage": {}}, "summaries": [],
             "persistedUris": [URI.format(1)], "start": "summary", "more": False, "clearedBefore": False}
    h = merge_pages([newest, older])
    assert [m["id"] for m in h["messages"]] == ["m0", "m1", "m2", "m3"] and h["anchorId"] == "m3"
    assert h["start"] == "summary" and not h["more"] and "nextAnchorId" not in h
    assert h["summaries"] == [{"boundaryId": "m0", "index": 0}]
    assert h["persistedUris"] == [URI.format(1), URI.format(2)] and h["lastUsage"]["messageId"] == "m1"


def test_a_window_keeps_what_the_rows_before_the_boundary_retained():
    stored = ("what happened\n\n[Files attached in this conversation remain readable in full via the read_file "
              "tool: a.txt]\n\n[Tool output archived from this conversation remains readable in full via the "
              f"fs_read tool at: {URI.format(1)}]")
    atts = [{"sha256": "1" * 64, "handle": "a.txt", "displayName": "a.txt", "mediaType": "text/plain", "size": 1},
            {"sha256": "2" * 64, "handle": "b.txt", "displayName": "b.txt", "mediaType": "text/plain", "size": 1}]
    rows = [msg("b", compactionSummary=stored), msg("n1", "assistant"), msg("n2")]
    hist = {"conversationId": "c", "messages": rows, "attachments": atts, "start": "summary",
            "clearedBefore": False}
    plan = plan_turn_start(hist, TurnStartSettings())
    assert plan.retained.persisted_uris == [URI.format(1)]  # fs_read stays offered for the archived output
    assert [a["handle"] for a in plan.retained.file_attachments] == ["a.txt", "b.txt"]
    assert plan.messages[0]["id"] == "compaction:b" and URI.format(1) in plan.messages[0]["parts"][0]["text"]
    # a clear marker before the boundary: only the attachments the summary named stay readable
    plan = plan_turn_start({**hist, "clearedBefore": True}, TurnStartSettings())
    assert [a["handle"] for a in plan.retained.file_attachments] == ["a.txt"]
