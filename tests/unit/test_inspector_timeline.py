"""The context inspector's derivations (issue #20): a turn's timeline rows and markers, the kept-prefix diff of
two requests, a conversation's tree, and the request rendering (escaped, markers highlighted, URIs linked)."""

from ctxbuild_codec.tokens import count_message
from ctxbuild_orchestration.inspector.render import linkify, part_view
from ctxbuild_orchestration.inspector.routes import script_json
from ctxbuild_orchestration.inspector.timeline import (
    conversation_view,
    path_to,
    prefix_kept,
    request_diff,
    trace_id_of,
    tree_rows,
    turn_timeline,
)

URI = "context://vfs/vfs_0123456789abcdef.txt"
TRIMMED = (f"head\n\n<persisted-output>\noutput truncated (300 lines, 9000 chars total)\nFull output: {URI}\n"
           "Read the full content with the fs_read tool.\n</persisted-output>\n\ntail")
TP = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"


def ev(type_, data, **extra):
    return {"type": type_, "data": data, **extra}


def user(mid, text, parent=None):
    return {"id": mid, "parentId": parent, "role": "user", "parts": [{"type": "text", "text": text}]}


def request(*messages, system="s", tools=()):
    return {"model": "m", "system": system, "tools": list(tools), "messages": list(messages)}


def test_trace_id_from_traceparent():
    assert trace_id_of({"traceparent": TP}) == "ab" * 16
    assert trace_id_of({"traceparent": "00-" + "0" * 32 + "-" + "cd" * 8 + "-01"}) is None
    assert trace_id_of({}) is None and trace_id_of(None) is None


def test_prefix_kept_and_diff():
    a, b, c = user("a", "task"), user("b", "x", "a"), user("c", "y", "b")
    first = prefix_kept(None, request(a))
    assert first["first"] and first["extends"]
    grown = prefix_kept(request(a, b), request(a, b, c))
    assert grown["extends"] and grown["kept"] == 2 and grown["messages"] == 3
    assert [d["state"] for d in request_diff(request(a, b), request(a, b, c))] == ["kept", "kept", "new"]
    rewritten = prefix_kept(request(a, b), request(a, user("b", "changed", "a"), c))
    assert not rewritten["extends"] and rewritten["kept"] == 1
    assert not prefix_kept(request(a), request(a, b, system="other"))["extends"]


def turn_events(*, folded=True):
    """Step 1 reads a page (trimmed, offloaded); an in-loop fold before step 2; step 2 answers."""
    out = [ev("TurnQueued", {"turnId": "t", "conversationId": "c", "userMessageId": "u"}),
           ev("TurnStarted", {"turnId": "t"}),
           ev("CompactionDecided", {"phase": "turn-start", "status": "skipped", "reason": "under-trigger"}),
           ev("StepServed", {"step": 1, "servedTokens": 100, "messagesServed": 1, "requestHash": "h1",
                             "request": {"sha256": "h1"}, "usage": {"inputTokens": 150, "cacheReadTokens": 40},
                             "assistantMessage": {"id": "a1", "role": "assistant", "parts": [
                                 {"type": "tool-call", "toolCallId": "k1", "toolName": "read_file",
                                  "input": {"filename": "f"}}]}}, metadata={"traceparent": TP}),
           ev("ToolCallRequested", {"step": 1, "toolCallId": "k1", "toolName": "read_file"}),
           ev("ToolResultRecorded", {"step": 1, "toolCallId": "k1", "toolName": "read_file", "trimmed": True,
                                     "output": {"type": "text", "value": TRIMMED},
                                     "offload": {"mode": "offloaded", "uri": URI, "totalChars": 9000}})]
    if folded:
        out += [ev("InLoopFoldRecorded", {"turnId": "t", "persistedUris": [URI]}),
                ev("CompactionDecided", {"phase": "in-loop", "status": "done", "preTokens": 900, "postTokens": 300,
                                         "step": 2, "summarizer": "extractive", "boundaryId": "b"})]
    out += [ev("StepServed", {"step": 2, "servedTokens": 120, "messagesServed": 3, "requestHash": "h2",
                              "request": {"sha256": "h2"}, "usage": {"inputTokens": 170}}),
            ev("TurnCompleted", {"turnId": "t", "steps": 2})]
    return out


def test_timeline_rows_markers_and_raw_history():
    task = user("u", "read f")
    r1 = request(task)
    r2 = request(task, {"id": "a1", "role": "assistant", "parts": []}, {"id": "t1", "role": "tool", "parts": []})
    tl = turn_timeline(turn_events(), {"contextWindow": 16_000}, [task], {1: r1, 2: r2})
    assert tl["status"] == "completed" and tl["window"] == 16_000 and tl["trigger"] == 12_800
    s1, s2 = tl["steps"]
    assert (s1["servedTokens"], s1["cacheReadTokens"], s1["traceId"]) == (100, 40, "ab" * 16)
    assert tl["cacheReported"] and s1["tools"] == ["read_file"]
    # the raw history starts from the path before the turn; step 2's adds step 1's answer and the FULL output
    assert s1["rawTokens"] == count_message(task)
    assert s2["rawTokens"] > s1["rawTokens"] + 1000  # 9,000 chars in full, not the ~60 served
    # the trimmed output is marked on the step whose request first carries it, with its archive
    kinds = [m["kind"] for m in s2["markers"]]
    assert kinds[:3] == ["compaction-in-loop", "trimmed", "offloaded"] and s1["markers"] == []
    assert next(m for m in s2["markers"] if m["kind"] == "trimmed")["uri"] == URI
    assert next(m for m in s2["markers"] if m["kind"] == "compaction-in-loop")["uris"] == [URI]
    # the request grew from step 1's: the prefix held
    assert s2["prefix"]["extends"] and "prefix-broke" not in kinds


def test_prefix_break_is_marked_expected_only_with_compaction():
    task, other = user("u", "read f"), user("x", "summary")
    for folded, expected in ((True, True), (False, False)):
        tl = turn_timeline(turn_events(folded=folded), {}, [task], {1: request(task), 2: request(other, task)})
        broke = [m for m in tl["steps"][1]["markers"] if m["kind"] == "prefix-broke"]
        assert len(broke) == 1 and broke[0]["expected"] is expected
        assert tl["window"] is None and tl["trigger"] is None
    # a request that was not kept: no prefix check for it (and the next one starts over)
    tl = turn_timeline(turn_events(), {}, [task], {1: None, 2: request(task)})
    assert tl["steps"][0]["prefix"] is None and tl["steps"][1]["prefix"]["first"]


def test_a_running_turn_and_results_of_the_last_step():
    events = turn_events(folded=False)[:-2]  # step 1 served, its result recorded, nothing after
    tl = turn_timeline(events, {"contextWindow": 8000}, [], {})
    assert tl["status"] == "running" and tl["terminal"] is None and len(tl["steps"]) == 1
    assert [m["kind"] for m in tl["steps"][0]["markers"]] == ["trimmed", "offloaded"]


def test_conversation_view_tree_branches_and_archives():
    part = {"type": "tool-result", "toolCallId": "k1", "toolName": "read_file",
            "output": {"type": "text", "value": "x"},
            "offload": {"mode": "offloaded", "uri": URI, "totalChars": 9}}
    transcript = "context://vfs/vfs_fedcba9876543210.txt"
    events = [
        ev("ConversationCreated", {"conversationId": "c", "tenantId": "t1", "title": "T",
                                   "settings": {"contextWindow": 1000}}, recordedAt="2026-01-01T00:00:00Z"),
        ev("AttachmentAdded", {"attachment": {"handle": "f", "sha256": "a" * 64}}),
        ev("UserMessageAdded", {"message": user("u", "hello")}),
        ev("AssistantMessageCompleted", {"turnId": "t", "messages": [
            {"id": "a1", "parentId": "u", "role": "assistant", "turnId": "t", "parts": []},
            {"id": "r1", "parentId": "a1", "role": "tool", "turnId": "t", "parts": [part]}]}),
        ev("AssistantMessageCompleted", {"turnId": "t2", "messages": [
            {"id": "a2", "parentId": "u", "role": "assistant", "turnId": "t2", "parts": []}]}),
        ev("CompactionSummaryRecorded", {"boundaryId": "a2", "summary": "s\n[The full transcript of the folded "
                                         f"part is readable via the fs_read tool at: {transcript}]"}),
    ]
    view = conversation_view(events)
    assert (view["title"], view["tenantId"], view["attachments"][0]["handle"]) == ("T", "t1", "f")
    assert [a["uri"] for a in view["archives"]] == [URI, transcript]
    assert view["summaries"]["a2"]["transcripts"] == [transcript]
    assert [m["id"] for m in path_to(view, "r1")] == ["u", "a1", "r1"]
    rows = tree_rows(view, {"u", "a2"})
    assert [(r["message"]["id"], r["depth"], r["siblings"], r["nth"], r["current"]) for r in rows] == [
        ("u", 0, 1, 1, True), ("a1", 1, 2, 1, False), ("r1", 1, 1, 1, False), ("a2", 1, 2, 2, True)]


def test_rendering_escapes_and_links():
    html = str(linkify("<b>x</b>\n" + TRIMMED, lambda u: f"/read?uri={u}"))
    assert "<b>" not in html and "&lt;b&gt;" in html
    assert '<mark class="trim"' in html and html.count(f'href="/read?uri={URI}"') == 1
    view = part_view({"type": "tool-result", "toolCallId": "k", "toolName": "read_file",
                      "output": {"type": "text", "value": TRIMMED}}, lambda u: u)
    assert view["trimmed"] and view["toolCallId"] == "k"
    # JSON inside a <script> element cannot close it
    assert "</script>" not in script_json({"x": "</script><script>alert(1)</script>"})
