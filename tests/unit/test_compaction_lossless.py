"""Lossless compaction (SPEC §15.2), pure and through the handler with an in-memory blob store: the task is pinned
through every fold (never folded, verbatim, at a byte-stable position), every text fold archives its increment as
one content-addressed transcript with every output in full, and the summary row names the transcripts of all
folds so far with the exact transcript line."""

from __future__ import annotations

import hashlib
import json

from ctxbuild_codec import trim_inflight, vfs_uri
from ctxbuild_codec.records import archived_uris
from ctxbuild_codec.tokens import count_messages
from ctxbuild_codec.turn_start.summary_row import TRANSCRIPT_LINE, transcripts_of
from ctxbuild_compaction.adapters.blobstore import BlobStore
from ctxbuild_compaction.app import Summarizers, in_loop, turn_start
from ctxbuild_compaction.domain import (
    Checkpoint,
    FoldOutcome,
    InLoopSettings,
    TurnStartSettings,
    extractive_summary,
    finish,
    finish_in_loop,
    orphans,
    plan_in_loop,
    plan_turn_start,
)
from ctxbuild_compaction.domain.transcript import render_transcript
from ctxbuild_platform import contracts

from tests.support.compaction import MemoryBlobs, NoHistory, in_loop_turn

W = 16_000
FIXED = 350
TASK = {"id": "u1", "role": "user", "parts": [
    {"type": "text", "text": "Find why the nightly export fails; the log is attached."},
    {"type": "file", "handle": "export.log", "displayName": "export.log", "mediaType": "text/plain",
     "sha256": "ab" * 32}]}
PAGE = "".join(f"2026-11-29T10:00:{i % 60:02d}.000Z INFO api-{i % 8} GET /v1/items/{i} 200 latency_ms={i % 97}.5\n"
               for i in range(110))  # ≈ 8,000 chars


def serve(summarizers, store):
    return lambda req: in_loop(req, NoHistory(), summarizers, checkpoints=store)


def page(step: int) -> str:
    return f"page {step} marker-{step:03d}\n" + PAGE


def call(step: int, thought: str = "") -> dict:
    parts = [{"type": "text", "text": thought}] if thought else []
    return {"id": f"a{step}", "role": "assistant", "turnId": "t",
            "parts": [*parts, {"type": "tool-call", "toolCallId": f"c{step}", "toolName": "read_file",
                               "input": {"filename": "export.log", "offset": step}}]}


def result(step: int, trim: bool) -> dict:
    part = {"type": "tool-result", "toolCallId": f"c{step}", "toolName": "read_file",
            "output": {"type": "text", "value": page(step)}}
    if trim:  # the in-flight lane: the full text goes to a blob, the model sees a head/tail marker
        part = trim_inflight(part, 2_400, lambda blob: vfs_uri(blob.sha256))
    return {"id": f"t{step}", "role": "tool", "turnId": "t", "parts": [part]}


def extractive(fold):
    return FoldOutcome("extractive", summary=extractive_summary(fold.previous_summary, fold.input_rows(), 1_500),
                       calls=1)


def task_in(served: list[dict]) -> bool:
    return any(m == TASK for m in served if m.get("role") == "user")


# ---------- pinning, pure ----------

def pure_loop(steps: int, outcome, *, history: list[dict] | None = None):
    messages = [*(history or []), TASK]
    ck, log = Checkpoint(), []
    for step in range(1, steps + 1):
        plan = plan_in_loop(messages, 0, ck, InLoopSettings(W, fixed_tokens=FIXED), turn_id="t", step=step)
        if plan.fold is not None:
            assert all(r["id"] != TASK["id"] for r in plan.fold.input_rows())  # never folded
            plan, _ = finish_in_loop(plan, outcome(plan.fold), f"context://vfs/vfs_{step:016x}.txt")
        ck = plan.checkpoint
        log.append((plan.decision, plan.served, ck))
        messages += [call(step, "Reading the next page. " * 20), result(step, trim=False)]
    return log


def test_the_task_is_pinned_verbatim_before_the_summary_in_every_request():
    earlier = [{"id": "u0", "role": "user", "parts": [{"type": "text", "text": "an earlier question"}]},
               {"id": "a0", "role": "assistant", "parts": [{"type": "text", "text": "an earlier answer"}]}]
    log = pure_loop(30, extractive, history=earlier)
    folds = [d for d, _, _ in log if d["status"] == "compacted"]
    assert len(folds) >= 3
    assert all(task_in(served) for _, served, _ in log)
    after = [(served, ck) for d, served, ck in log if ck.folds]
    # byte-stable position: the task first, the summary row right after it
    assert all(served[0] == TASK and served[1]["id"].startswith("compaction:") for served, _ in after)
    assert all(ck.task_id == "u1" for _, ck in after)
    assert all(orphans(served) == {"calls": [], "results": []} for _, served, _ in log)
    assert all(FIXED + count_messages(served) <= W for _, served, _ in log)
    # the earlier turn's rows were folded, the task was not
    assert all(m["id"] not in ("u0", "a0") for m in log[-1][1])


def test_the_summary_row_names_every_fold_transcript_oldest_first():
    log = pure_loop(30, extractive)
    last_ck = log[-1][2]
    row = log[-1][1][1]
    text = row["parts"][0]["text"]
    assert len(last_ck.transcripts) == last_ck.folds >= 3
    assert text.endswith("\n\n" + TRANSCRIPT_LINE + ", ".join(last_ck.transcripts) + "]")
    assert transcripts_of(text) == last_ck.transcripts
    # one fold: exactly the line of SPEC §15.2
    first = next(served for d, served, _ in log if d["status"] == "compacted")
    uri = transcripts_of(first[1]["parts"][0]["text"])[0]
    assert first[1]["parts"][0]["text"].endswith(
        f"\n\n[The full transcript of the folded part is readable via the fs_read tool at: {uri}]")


def test_masking_keeps_the_task_where_it_was():
    def mask(fold):
        return FoldOutcome("masking", rows=[dict(r) for r in fold.rows])
    log = pure_loop(20, mask)
    assert any(ck.folds for _, _, ck in log)
    assert all(task_in(served) for _, served, _ in log)
    assert all(served[0] == TASK for _, served, _ in log)


def test_the_checkpoint_round_trips_the_task_and_transcripts():
    from ctxbuild_compaction.domain import summary_row

    uri = "context://vfs/vfs_0000000000000001.txt"
    ck = Checkpoint(3, [TASK, summary_row("t2", "- s", ["export.log"], [uri])], 5, 2, ["export.log"], [uri],
                    "extractive", 4, "u1")
    assert "transcripts" not in ck.to_payload()   # the summary row names them: the event does not grow per fold
    assert Checkpoint.from_payload(ck.to_payload()) == ck
    contracts.validate("subjects/ctx.compact.in_loop.request.json",
                       {"conversationId": "c", "turnId": "t", "messages": [], "checkpoint": ck.to_payload()})


def test_turn_start_keeps_the_current_user_message_verbatim():
    """By construction: the keep boundary is a user row at or before the newest one (the turn's message)."""
    filler = "word " * 900
    rows = []
    for i in range(6):
        rows += [{"id": f"q{i}", "role": "user", "parts": [{"type": "text", "text": f"question {i} {filler}"}]},
                 {"id": f"x{i}", "role": "assistant", "parts": [{"type": "text", "text": f"answer {i} {filler}"}]}]
    rows.append(TASK)
    plan = plan_turn_start({"messages": rows, "attachments": []}, TurnStartSettings(context_window=4_000))
    assert plan.fold is not None and all(r["id"] != "u1" for r in plan.fold.rows)
    done = finish(plan, extractive(plan.fold), transcript="context://vfs/vfs_00000000000000aa.txt")
    assert done.messages[-1] == TASK and done.decision["status"] == "compacted"
    assert done.messages[0]["parts"][0]["text"].endswith(
        "\n\n[The full transcript of the folded part is readable via the fs_read tool at: "
        "context://vfs/vfs_00000000000000aa.txt]")
    assert "context://vfs/vfs_00000000000000aa.txt" in done.retained.persisted_uris
    assert done.summary_text.endswith("context://vfs/vfs_00000000000000aa.txt]")


# ---------- the transcript ----------

async def test_a_transcript_holds_offloaded_outputs_in_full_and_is_byte_stable():
    blobs = MemoryBlobs()
    store = BlobStore(blobs, 5.0)
    rows = [TASK, call(1, "Let me look."), result(1, trim=True), call(2), result(2, trim=False)]
    # the in-flight lane's blob (what truncation stored) is in the store
    await blobs.put(page(1), "conv", ("turn", "t"), "provisional")
    assert rows[2]["parts"][0]["offload"]["mode"] == "offloaded"
    assert page(1) not in json.dumps(rows)   # served trimmed
    uri = await store.archive(rows, "conv", "t")
    text = blobs.text(uri)
    assert page(1) in text and page(2) in text   # both outputs in full
    assert '[tool call c1] read_file {"filename":"export.log","offset":1}' in text   # compact, as on the wire
    assert text.startswith("### [1] user u1\nFind why the nightly export fails; the log is attached.\n"
                           "[file export.log] export.log (text/plain)\n### [2] assistant a1\nLet me look.\n")
    # owned by the turn as a tool output: not released with the turn's provisional blobs
    assert (uri[-20:-4], ("turn", "t"), "tool_output") in [(vfs_uri(s)[-20:-4], o, r) for s, o, r in blobs.refs]
    # the same folded span gives the same bytes (the same URI) whoever archives it
    again = await BlobStore(blobs, 5.0).archive(json.loads(json.dumps(rows)), "conv", "t")
    assert again == uri
    assert render_transcript([TASK]) == render_transcript([json.loads(json.dumps(TASK))])
    assert render_transcript(rows[:2]) != render_transcript(rows[:3])


async def test_a_transcript_declares_the_folded_outputs_as_its_members():
    """The folded rows' own archived URIs go with the transcript's put (the blob store keeps them readable while
    the transcript is retained); the transcript's text stays the same."""
    blobs = MemoryBlobs()
    rows = [TASK, call(1, "Let me look."), result(1, trim=True), call(2), result(2, trim=False)]
    await blobs.put(page(1), "conv", ("turn", "t"), "provisional")
    uri = await BlobStore(blobs, 5.0).archive(rows, "conv", "t")
    sha = next(s for s in blobs.objects if vfs_uri(s) == uri)
    offloaded = rows[2]["parts"][0]["offload"]["uri"]
    assert blobs.members[sha] == archived_uris(rows) == [offloaded]


async def test_every_folded_output_is_in_a_transcript_the_last_request_names():
    """Three folds or more through the handler: each fold's increment is archived, the last served request names
    every transcript, and together they hold every page the fold took away, in full."""
    blobs = MemoryBlobs()
    store = BlobStore(blobs, 5.0)
    summarizers = Summarizers("extractive", put=store.put)

    async def step_rows(step, _reply):
        await blobs.put(page(step), "conv", ("turn", "t"), "provisional")  # what truncation stored
        return [call(step), result(step, trim=True)]

    replies = [r for r, _ in await in_loop_turn(45, [TASK], step_rows, serve=serve(summarizers, store),
                                                window=W, fixed=FIXED)]
    folds = [r for r in replies if r["checkpointChanged"]]
    assert len(folds) >= 3 and all(r["decision"].get("transcript") for r in folds)
    assert all(task_in(r["messages"]) for r in replies)
    last = replies[-1]["messages"]
    named = transcripts_of(last[1]["parts"][0]["text"])
    assert named == [r["decision"]["transcript"] for r in folds]
    archived = "".join(blobs.text(u) for u in named)
    served = json.dumps(last)
    for step in range(1, 45):
        if f"c{step}\"" not in served:   # folded away: its page is in a transcript, in full
            assert page(step) in archived, step


async def test_a_turn_start_fold_archives_its_span_and_later_turns_keep_the_link():
    from tests.unit.test_compaction_domain import history, long_history
    from tests.unit.test_compaction_handler import Counting, FakeHistory, request, valid

    blobs = MemoryBlobs()
    hist = FakeHistory(history(long_history()))
    reply = valid(await turn_start(request(contextWindow=4_000), hist, Counting(), archive=BlobStore(blobs, 5.0)))
    d = reply["decision"]
    assert d["status"] == "compacted" and d["stored"] and d["transcript"] in reply["retained"]["persistedUris"]
    row = reply["messages"][0]["parts"][0]["text"]
    assert row.endswith(f"\n\n[The full transcript of the folded part is readable via the fs_read tool at: "
                        f"{d['transcript']}]")
    folded_ids = [m["id"] for m in long_history()][: d["foldedCount"]]
    assert [ln.split()[-1] for ln in blobs.text(d["transcript"]).splitlines() if ln.startswith("### [")] \
        == folded_ids
    # a later turn reads the stored summary back: the same row bytes, the transcript still retained (readable)
    later = valid(await turn_start(request(contextWindow=100_000), hist, Counting()))
    assert later["messages"][0]["parts"][0]["text"] == row
    assert d["transcript"] in later["retained"]["persistedUris"]


async def test_masking_on_a_long_run_collapses_its_prefix_and_stays_in_the_window():
    """Masking alone grows without bound on a long run (every masked call and answer stays); once its prefix no
    longer fits the trigger it is collapsed into a summary row with a transcript — the task still pinned."""
    blobs = MemoryBlobs()
    store = BlobStore(blobs, 5.0)
    summarizers = Summarizers("masking", put=store.put)
    thought = "I will read the next page of the export log and compare it with what I found before. " * 6

    async def step_rows(step, _reply):
        return [call(step, thought), result(step, trim=False)]

    replies = [r for r, _ in await in_loop_turn(80, [TASK], step_rows, serve=serve(summarizers, store),
                                                window=W, fixed=FIXED)]
    # what masking archived outlives the turn's provisional blobs (a served link stays readable)
    masked = {hashlib.sha256(page(k).encode()).hexdigest() for k in range(1, 81)} & set(blobs.objects)
    assert masked and all((sha, ("turn", "t"), "tool_output") in blobs.refs for sha in masked)
    collapsed = [r for r in replies if r["decision"].get("note") == "masking-collapsed"]
    assert collapsed and all(r["decision"]["summarizer"] == "masking" for r in collapsed)
    assert all(FIXED + count_messages(r["messages"]) <= W for r in replies)
    assert all(task_in(r["messages"]) for r in replies)
    assert all(orphans(r["messages"]) == {"calls": [], "results": []} for r in replies)
    # after a collapse: [task, summary row naming its transcript, masked rows…]
    last = replies[-1]["messages"]
    assert last[0] == TASK and last[1]["id"].startswith("compaction:")
    assert transcripts_of(last[1]["parts"][0]["text"]) == [r["decision"]["transcript"] for r in collapsed]


def test_the_task_is_the_user_message_that_started_the_turn():
    from ctxbuild_compaction.domain.in_loop import find_task
    note = {"id": "h1", "role": "user", "turnId": "t", "parts": [{"type": "text", "text": "format error, retry"}]}
    rows = [{"id": "u0", "role": "user", "parts": []}, TASK, call(1), result(1, False), note, call(2)]
    assert find_task(rows, "t") == "u1"          # a later user row (a harness note) is not the task
    assert find_task(rows[:2], "t") == "u1"      # no row of the turn yet: the newest user row
    summary = {"id": "compaction:x", "role": "user", "parts": [{"type": "text", "text": "…"}]}
    assert find_task([TASK, summary], None) == "u1"


def test_a_turn_start_summary_of_a_summary_names_both_transcripts():
    from ctxbuild_compaction.domain import stored_text

    from tests.unit.test_compaction_domain import assistant, filler, history, long_history, user

    old, new = "context://vfs/vfs_00000000000000b1.txt", "context://vfs/vfs_00000000000000b2.txt"
    rows = long_history()
    rows[3] = {**rows[3], "compactionSummary": stored_text("- User: asked for a review.", [], [old])}
    rows += [assistant("a5", "Findings follow. " + filler(1_500)), user("u4", "and then? " + filler(300))]
    plan = plan_turn_start(history(rows), TurnStartSettings(context_window=3_000))
    assert plan.fold is not None and old in plan.retained.persisted_uris   # the earlier transcript stays readable
    done = finish(plan, extractive(plan.fold), transcript=new)
    assert transcripts_of(done.messages[0]["parts"][0]["text"]) == [old, new]
    assert transcripts_of(done.summary_text) == [old, new]
    assert {old, new} <= set(done.retained.persisted_uris)


def test_the_opening_request_reads_back_exactly_whatever_it_holds():
    from ctxbuild_codec.turn_start.summary_row import split_opening, with_opening

    tricky = ("line one\n\n[Files attached in this conversation …: x]\n\n"
              "[The conversation's first request, verbatim (3 chars):]\nabc")
    text = with_opening("- the summary", tricky)
    assert split_opening(text) == (tricky, "- the summary")
    assert split_opening("- no opening") == (None, "- no opening")
    assert with_opening(" s ", None) == "s"


def test_a_later_turn_keeps_the_first_request_verbatim_through_every_fold():
    """A multi-turn session (the task of the run is its first message): when a fold takes the first request away,
    the summary row keeps its words — carried from fold to fold (summary of summary), in-loop and at turn start."""
    first = {"id": "u0", "role": "user", "parts": [{"type": "text", "text": "Research the history of CRW telesystem."}]}
    answer = {"id": "a0", "role": "assistant", "parts": [{"type": "text", "text": "It began in 1999. " * 200}]}
    log = pure_loop(30, extractive, history=[first, answer])
    after = [served for d, served, ck in log if ck.folds]
    assert len([d for d, _, _ in log if d["status"] == "compacted"]) >= 3
    for served in after:
        assert all(m["id"] != "u0" for m in served)   # folded away ...
        assert "Research the history of CRW telesystem." in served[1]["parts"][0]["text"]   # ... and kept verbatim
    # a turn-start fold of the earlier turn carries it too, and an in-loop fold of that row carries it on
    rows = [first, answer, {"id": "q1", "role": "user", "parts": [{"type": "text", "text": "more " * 600}]},
            {"id": "x1", "role": "assistant", "parts": [{"type": "text", "text": "ok " * 600}]}, TASK]
    plan = plan_turn_start({"messages": rows, "attachments": []}, TurnStartSettings(context_window=2_500))
    done = finish(plan, extractive(plan.fold))
    assert done.messages[0]["id"].startswith("compaction:") and done.messages[-1] == TASK
    assert "Research the history of CRW telesystem." in done.summary_text
    ck, messages = Checkpoint(), [*done.messages]
    for step in range(1, 12):
        p = plan_in_loop(messages, 0, ck, InLoopSettings(4_000, fixed_tokens=FIXED), turn_id="t")
        if p.fold is not None:
            p, _ = finish_in_loop(p, extractive(p.fold))
        ck = p.checkpoint
        assert any("Research the history of CRW telesystem." in m["parts"][0].get("text", "")
                   for m in p.served if m["role"] == "user"), step
        messages += [call(step), result(step, trim=False)]
    assert ck.folds >= 1


def test_a_json_output_is_in_the_transcript_as_the_wire_shows_it():
    items = [{"id": "e-1", "title": "Main", "url": "https://example.test/", "content": "snippet one"}]
    rows = [{"id": "a1", "role": "assistant", "parts": [
                {"type": "tool-call", "toolCallId": "c1", "toolName": "web_search", "input": {"query": "q"}}]},
            {"id": "t1", "role": "tool", "parts": [{"type": "tool-result", "toolCallId": "c1", "toolName": "web_search",
                                                   "output": {"type": "json", "value": items}}]}]
    text = render_transcript(rows)
    assert json.dumps(items, ensure_ascii=False, separators=(",", ":")) in text
    assert '[tool call c1] web_search {"query":"q"}' in text


def test_a_first_request_too_large_for_the_stored_event_stays_in_the_transcript_only():
    huge = {"id": "u0", "role": "user", "parts": [{"type": "text", "text": "spec " * 20_000}]}   # 100 KB
    rows = [huge, {"id": "x0", "role": "assistant", "parts": [{"type": "text", "text": "ok " * 600}]}, TASK]
    plan = plan_turn_start({"messages": rows, "attachments": []}, TurnStartSettings(context_window=2_500))
    done = finish(plan, extractive(plan.fold), transcript="context://vfs/vfs_00000000000000c1.txt")
    assert plan.opening is None and "first request, verbatim" not in done.summary_text
    assert len(done.summary_text.encode()) < 32 * 1024 and done.messages[-1] == TASK
