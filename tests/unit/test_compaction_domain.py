"""Turn-start compaction (SPEC §8): budgets, the serve/compact decision, the keep boundary, the summary row,
and the retained context computed from the raw path (finding #2)."""

from __future__ import annotations

import pytest
from ctxbuild_codec import compaction_budget
from ctxbuild_codec.tokens import count_message, count_messages
from ctxbuild_codec.turn_start.summary_row import split_opening, summary_of_row, with_opening
from ctxbuild_compaction.domain import (
    TurnStartSettings,
    after_clear,
    estimate_tokens,
    extractive_summary,
    finish,
    keep_start,
    max_messages_window,
    persisted_uris,
    plan_turn_start,
    split_stored,
    splits_tool_pair,
    stored_summary_row,
    stored_text,
    summary_row,
    summary_row_text,
)


def extractive(fold):
    return extractive_summary(fold.previous_summary, fold.input_rows(), fold.max_chars)

SHA_A = "a" * 64
SHA_B = "b" * 64
URI = "context://vfs/vfs_0123456789abcdef.txt"
W = TurnStartSettings(context_window=4_000)


def filler(n: int) -> str:
    return "lorem " * n  # ≈ n + 2 tokens


def user(mid, text, *files):
    parts = [{"type": "text", "text": text}]
    parts += [{"type": "file", "handle": h, "displayName": h, "mediaType": "application/pdf", "sha256": sha}
              for h, sha in files]
    return {"id": mid, "role": "user", "parts": parts}


def assistant(mid, text, *calls, usage=None):
    parts = [{"type": "text", "text": text}] if text else []
    parts += [{"type": "tool-call", "toolCallId": cid, "toolName": name, "input": {"q": "x"}} for cid, name in calls]
    row = {"id": mid, "role": "assistant", "parts": parts}
    if usage:
        row["usage"] = {"inputTokens": usage[0], "outputTokens": usage[1]}
    return row


def tool(mid, call_id, name, text, offload_uri=None):
    part = {"type": "tool-result", "toolCallId": call_id, "toolName": name, "output": {"type": "text", "value": text}}
    if offload_uri:
        part["offload"] = {"mode": "offloaded", "uri": offload_uri, "totalChars": 9_000, "totalLines": 10}
    return {"id": mid, "role": "tool", "parts": [part]}


def long_history():
    """≈ 3,500 tokens; with W = 4,000 (trigger 3,200, keep 1,200) the keep boundary falls after `a2`."""
    return [
        user("u1", "Please review the attached report. " + filler(480), ("report.pdf", SHA_A)),
        assistant("a1", "Searching the web for context. " + filler(480), ("c1", "web_search")),
        tool("t1", "c1", "web_search", filler(1_000)),
        assistant("a2", "The report looks consistent with public data. " + filler(800)),
        user("u2", "Now check the numbers in section two. " + filler(100)),
        assistant("a3", "", ("c2", "fs_read")),
        tool("t2", "c2", "fs_read", filler(200), offload_uri=URI),
        assistant("a4", "Section two adds up. " + filler(200)),
        user("u3", "Thanks, summarize the findings. " + filler(100)),
    ]


def history(messages, attachments=()):
    return {"conversationId": "conv-1", "messages": messages, "attachments": list(attachments)}


REPORT = {"sha256": SHA_A, "handle": "report.pdf", "displayName": "report.pdf", "mediaType": "application/pdf",
          "size": 1234}


def run(hist, settings=W, summarizer=extractive):
    plan = plan_turn_start(hist, settings)
    if plan.fold is not None:
        plan = finish(plan, summarizer(plan.fold))
    return plan.reply()


# ---------- budgets ----------

def test_budget_vectors():
    b = compaction_budget(4_000)
    assert (b.input_room, b.trigger, b.keep) == (4_000, 3_200, 1_200)
    b = compaction_budget(4_000, 1_000)
    assert (b.input_room, b.trigger, b.keep) == (3_000, 2_400, 900)
    assert compaction_budget(None) is None and compaction_budget(float("inf")) is None


# ---------- serve ----------

def test_under_trigger_serves_history_as_is():
    rows = [user("u1", "hi"), assistant("a1", "hello"), user("u2", "how are you?")]
    reply = run(history(rows))
    assert reply["messages"] == rows
    d = reply["decision"]
    assert d["status"] == "serve" and d["phase"] == "turn-start" and d["reason"] == "under-trigger"
    assert d["estimatedTokens"] == count_messages(rows) and (d["trigger"], d["keepBudget"]) == (3_200, 1_200)


def test_compaction_off_or_window_unknown_serves():
    rows = long_history()
    off = run(history(rows), TurnStartSettings(context_window=4_000, compress_enabled=False))
    assert off["messages"] == rows and off["decision"]["reason"] == "compaction-disabled"
    for window in (None, 0, float("nan")):
        unknown = run(history(rows), TurnStartSettings(context_window=window))
        assert unknown["messages"] == rows and unknown["decision"]["status"] == "serve"
        assert unknown["decision"]["reason"] == "window-unknown" and "trigger" not in unknown["decision"]


def test_estimate_trusts_last_usage_and_estimates_the_rest():
    rows = [user("u1", filler(50)), assistant("a1", "ok", usage=(5_000, 40)), user("u2", filler(10))]
    assert estimate_tokens(rows) == 5_040 + count_message(rows[2])
    assert estimate_tokens(rows[:1]) == count_message(rows[0])
    # usage says the prompt is big although the rows look small → compaction decides on the real figure
    reply = run(history(rows))
    assert reply["decision"]["estimatedTokens"] == 5_040 + count_message(rows[2])


# ---------- compaction ----------

def test_over_trigger_compacts_at_a_user_boundary():
    rows = long_history()
    assert count_messages(rows) > 3_200
    reply = run(history(rows, [REPORT]))
    d = reply["decision"]
    assert d["status"] == "compacted" and d["reason"] == "over-trigger"
    assert d["boundaryId"] == "a2" and d["foldedCount"] == 4
    served = reply["messages"]
    assert served[0]["id"] == "compaction:a2" and served[0]["role"] == "user"
    assert [m["id"] for m in served[1:]] == ["u2", "a3", "t2", "a4", "u3"]
    assert served[1]["role"] == "user"
    assert count_messages(served[1:]) <= 1_200
    assert d["postTokens"] == count_messages(served) < d["estimatedTokens"]
    assert not splits_tool_pair(rows, rows.index(served[1]))


def test_keep_boundary_never_splits_a_tool_call_from_its_result():
    rows = [user("u0", "start"), assistant("a0", "ok"),
            user("u1", "go"), assistant("a1", filler(2_000), ("c1", "web_search")),
            user("ui", "(interjection while the tool ran)"), tool("t1", "c1", "web_search", "result"),
            assistant("a2", "done"), user("u2", "next")]
    # the earliest user row that fits is `ui`, but keeping from it would orphan t1's call
    assert splits_tool_pair(rows, 4)
    assert keep_start(rows, 1_200) == 2
    assert not splits_tool_pair(rows, 2)


def test_tool_ids_reused_across_turns_do_not_pin_the_boundary_to_the_start():
    """Ids are unique only within a turn (replays and some servers reuse call_1_1 each turn): pairing is by
    position, so a cut between two complete turns is not a split (it was read as one and kept nothing foldable)."""
    rows = []
    for k in range(4):
        rows += [user(f"u{k}", f"turn {k}"), assistant(f"a{k}", "", ("call_1_1", "bash")),
                 tool(f"t{k}", "call_1_1", "bash", filler(600)), assistant(f"f{k}", "done")]
    cut = rows.index(next(r for r in rows if r["id"] == "u3"))
    assert not splits_tool_pair(rows, cut)
    assert splits_tool_pair(rows, cut + 2)  # between a3's call and t3's result
    assert keep_start(rows, 1_200) == cut
    # an orphaned call (no result) followed by the same id later is not a split either
    orphan = [user("u0", "x"), assistant("a0", "", ("c", "bash")), user("u1", "y"), assistant("a1", "", ("c", "bash")),
              tool("t1", "c", "bash", "r")]
    assert not splits_tool_pair(orphan, 2)


def test_keep_boundary_falls_back_to_last_user_row():
    rows = [user("u1", "a"), assistant("a1", "b"), user("u2", filler(3_000))]
    assert keep_start(rows, 1_200) == 2
    assert keep_start([assistant("a1", "b")], 1_200) is None


def test_nothing_to_fold_is_skipped():
    rows = [user("u1", filler(5_000))]
    reply = run(history(rows))
    assert reply["decision"]["status"] == "skipped" and reply["decision"]["reason"] == "nothing-to-fold"
    assert reply["messages"] == rows


@pytest.mark.parametrize("summarizer, reason", [(lambda fold: "  ", "empty-summary")])
def test_empty_summary_is_skipped(summarizer, reason):
    rows = long_history()
    reply = run(history(rows), summarizer=summarizer)
    assert reply["decision"]["status"] == "skipped" and reply["decision"]["reason"] == reason
    assert reply["messages"] == rows


def test_summarizer_error_is_skipped():
    rows = long_history()
    plan = finish(plan_turn_start(history(rows), W), None, error="boom")
    assert plan.decision["status"] == "skipped" and plan.decision["reason"] == "summarizer-error"
    assert plan.messages == rows


# ---------- the summary row ----------

def test_summary_row_text_literal():
    row = summary_row("a2", "- User: Please review the attached report.",
                      ["report.pdf", "data (2).csv"], [URI])
    assert row == {"id": "compaction:a2", "role": "user", "parts": [{"type": "text", "text": (
        "This session is being continued from an earlier conversation that ran out of context. "
        "The earlier part of the conversation is summarized below.\n"
        "\n"
        "- User: Please review the attached report.\n"
        "\n"
        "Continue the conversation from where it left off without acknowledging this summary; "
        "the messages after it are the most recent ones.\n"
        "\n"
        "[Files attached in this conversation remain readable in full via the read_file tool: "
        "report.pdf, data (2).csv]\n"
        "\n"
        "[The full transcript of the folded part is readable via the fs_read tool at: "
        "context://vfs/vfs_0123456789abcdef.txt]")}]}
    assert summary_row_text("S") == (
        "This session is being continued from an earlier conversation that ran out of context. "
        "The earlier part of the conversation is summarized below.\n\nS\n\n"
        "Continue the conversation from where it left off without acknowledging this summary; "
        "the messages after it are the most recent ones.")


def test_compacted_summary_row_is_extractive_and_lists_folded_attachment():
    reply = run(history(long_history(), [REPORT]))
    text = reply["messages"][0]["parts"][0]["text"]
    # the conversation's first request (folded with u1) leads the summary, verbatim and length-prefixed
    opening, summary = split_opening(summary_of_row(reply["messages"][0]))
    assert opening == long_history()[0]["parts"][0]["text"]
    summary = summary.split("\n\n")[0]
    lines = summary.splitlines()
    assert lines[0] == "Earlier messages:"
    assert lines[1].startswith("- User: Please review the attached report.") and lines[1].endswith(
        " [attached: report.pdf]")
    assert lines[2].startswith("- Assistant: Searching the web for context.")
    assert lines[2].endswith(' [called: web_search(q=x) → 6,000 chars]')
    assert lines[3].startswith("- Assistant: The report looks consistent with public data.")
    assert len(lines) == 4 and all(len(ln) <= 300 + 60 for ln in lines)
    assert text == summary_row_text(with_opening(summary, opening), ["report.pdf"], [])


def test_attachment_retained_when_its_message_is_folded():
    """Finding #2: the attachment's message is folded away, read_file must stay offered and allowed."""
    reply = run(history(long_history(), [REPORT]))
    served_files = [p for m in reply["messages"] for p in m["parts"] if p["type"] == "file"]
    assert served_files == []  # u1 (the file's message) was folded
    assert reply["retained"]["fileAttachments"] == [
        {"sha256": SHA_A, "handle": "report.pdf", "displayName": "report.pdf"}]
    assert reply["retained"]["persistedUris"] == [URI]
    assert "read_file tool: report.pdf]" in reply["messages"][0]["parts"][0]["text"]


def test_summary_row_bytes_depend_only_on_the_boundary():
    """The row is fixed when the summary is made and stored with it; a later attachment never changes it."""
    rows = long_history()
    plan = plan_turn_start(history(rows, [REPORT]), W)
    plan = finish(plan, extractive(plan.fold))
    first = plan.reply()
    assert plan.summary_text.endswith("\n\n[Files attached in this conversation remain readable in full via the "
                                      "read_file tool: report.pdf]")
    # stored at its boundary (what persistence serves back as compactionSummary)
    stored = [{**r, "compactionSummary": plan.summary_text} if r["id"] == "a2" else r for r in rows]
    later_file = {**REPORT, "sha256": SHA_B, "handle": "late.csv", "displayName": "late.csv"}
    second = run(history(stored, [REPORT, later_file]), TurnStartSettings(context_window=100_000))
    assert second["decision"]["status"] == "serve"
    assert second["messages"][0] == first["messages"][0]
    assert [a["handle"] for a in second["retained"]["fileAttachments"]] == ["report.pdf", "late.csv"]
    # a later attachment on a kept row: still the same bytes
    rows2 = [*stored[:-1], user("u3", rows[-1]["parts"][0]["text"], ("late.csv", SHA_B))]
    third = run(history(rows2, [REPORT, later_file]), TurnStartSettings(context_window=100_000))
    assert third["messages"][0] == first["messages"][0]
    assert "late.csv" not in third["messages"][0]["parts"][0]["text"]
    assert [a["handle"] for a in third["retained"]["fileAttachments"]] == ["report.pdf", "late.csv"]


def test_attachment_without_a_file_part_is_named_by_the_summary_row():
    """Finding #2: an attachment uploaded on its own (no file part on any row) is still named by the row."""
    rows = [{**r, "parts": [p for p in r["parts"] if p["type"] != "file"]} for r in long_history()]
    loose = {**REPORT, "handle": "service.log", "displayName": "service.log", "mediaType": "text/plain"}
    reply = run(history(rows, [loose]))
    assert reply["decision"]["status"] == "compacted"
    # (the only archived output, t2, is on a kept row: no archive line)
    assert reply["messages"][0]["parts"][0]["text"].endswith(
        "[Files attached in this conversation remain readable in full via the read_file tool: service.log]")


def test_stored_summary_trailer_round_trip():
    text = stored_text("- the summary\n\nwith two paragraphs", ["a.txt", "b, c.csv"], [URI])
    assert split_stored(text) == ("- the summary\n\nwith two paragraphs", text[len("- the summary\n\nwith two "
                                                                                  "paragraphs"):])
    assert stored_summary_row("a2", text) == summary_row("a2", "- the summary\n\nwith two paragraphs",
                                                         ["a.txt", "b, c.csv"], [URI])
    assert split_stored("plain summary") == ("plain summary", None)
    assert stored_summary_row("a2", "plain", ["x"]) == summary_row("a2", "plain", ["x"], [])


def test_stored_summary_is_served_and_refolded_as_previous_summary():
    rows = long_history()
    rows[3] = {**rows[3], "compactionSummary": "- User: asked for a review."}
    small = run(history(rows, [REPORT]), TurnStartSettings(context_window=100_000))
    assert small["decision"]["status"] == "serve"
    assert [m["id"] for m in small["messages"]] == ["compaction:a2", "u2", "a3", "t2", "a4", "u3"]
    assert small["messages"][0] == summary_row("a2", "- User: asked for a review.", ["report.pdf"], [])
    # retained context still comes from the raw path
    assert [a["handle"] for a in small["retained"]["fileAttachments"]] == ["report.pdf"]

    extra = [assistant("a5", "Findings follow. " + filler(1_500)), user("u4", "and then? " + filler(300))]
    tight = run(history([*rows, *extra], [REPORT]), TurnStartSettings(context_window=3_000))
    d = tight["decision"]
    assert d["status"] == "compacted" and d["boundaryId"] != "a2"
    summary = tight["messages"][0]["parts"][0]["text"]
    assert "Summary of the conversation before that:\n- User: asked for a review." in summary
    assert "- User: Now check the numbers in section two" in summary
    # the archived outputs are no longer listed one by one (a fold's transcript stands for them, SPEC §15.2)
    assert "[Tool output archived from this conversation" not in summary


# ---------- clear context and the maxMessages window ----------

def test_clear_context_drops_earlier_rows_and_their_reads():
    rows = [user("u1", "old", ("report.pdf", SHA_A)), assistant("a1", "ok"),
            {"id": "clr", "role": "user", "parts": [], "clearContext": True},
            user("u2", "fresh start")]
    kept, cut = after_clear(rows)
    assert [m["id"] for m in kept] == ["u2"] and cut
    reply = run(history(rows, [REPORT]))
    assert [m["id"] for m in reply["messages"]] == ["u2"]
    assert reply["retained"]["fileAttachments"] == []


def test_max_messages_window_extends_back_to_user_and_revokes_older_reads():
    rows = long_history()
    window = max_messages_window(rows, 3)  # last 3 = t2, a4, u3 → extended back to u2
    assert [m["id"] for m in window] == ["u2", "a3", "t2", "a4", "u3"]
    stored = [*rows[:3], {**rows[3], "compactionSummary": "ignored in window mode"}, *rows[4:]]
    reply = run(history(stored, [REPORT]), TurnStartSettings(context_window=None, compress_enabled=False,
                                                             max_messages=3))
    assert [m["id"] for m in reply["messages"]] == ["u2", "a3", "t2", "a4", "u3"]
    assert reply["retained"] == {"fileAttachments": [], "persistedUris": [URI]}
    assert max_messages_window(rows, 100) == rows


def test_unrestricted_history_keeps_whole_attachment_list():
    other = {**REPORT, "sha256": SHA_B, "handle": "loose.txt", "displayName": "loose.txt"}
    reply = run(history([user("u1", "hi")], [REPORT, other]))
    assert [a["handle"] for a in reply["retained"]["fileAttachments"]] == ["report.pdf", "loose.txt"]


def test_persisted_uris_from_typed_provenance_only():
    rows = [
        tool("t1", "c1", "x", "<persisted-output>\nFull output: context://vfs/vfs_ffffffffffffffff.txt\n"),
        {"id": "t2", "role": "tool", "parts": [{"type": "tool-result", "toolCallId": "c2", "toolName": "web_fetch",
                                                "output": {"type": "persisted", "value": {
                                                    "vfsFilename": "vfs_1111111111111111.txt"}}}]},
        {"id": "t3", "role": "tool", "parts": [{"type": "tool-result", "toolCallId": "c3", "toolName": "web_search",
                                                "output": {"type": "persisted", "value": {"skeleton": [], "blobRefs": [
                                                    {"key": "/0/content",
                                                     "vfsFilename": "vfs_2222222222222222.txt"}]}}}]},
        tool("t4", "c4", "x", "y", offload_uri=URI), tool("t5", "c5", "x", "y", offload_uri=URI),
    ]
    assert persisted_uris(rows) == ["context://vfs/vfs_1111111111111111.txt",
                                    "context://vfs/vfs_2222222222222222.txt", URI]


# ---------- extractive summarizer ----------

def test_extractive_caps_and_omits_oldest_first():
    rows = [user(f"u{i}", f"Question number {i} about the topic at hand.") for i in range(200)]
    s = extractive_summary(None, rows, max_chars=1_000)
    assert len(s) <= 1_000 + 60 and "earlier messages omitted" in s
    assert s.endswith("- User: Question number 199 about the topic at hand.")
    assert extractive_summary(None, [{"id": "s", "role": "system", "parts": []}]) == ""
