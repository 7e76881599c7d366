"""In-loop compaction (SPEC §9), pure: atomic turn grouping, the memoised fold, increment-only folds (finding #4),
the tool-pair invariant, the usage-based estimate and the checkpoint payload."""

from __future__ import annotations

import itertools
import json

import pytest
from ctxbuild_blobclient import content_ref
from ctxbuild_codec import compaction_budget, trim_inflight, vfs_uri
from ctxbuild_codec.tokens import count_messages, count_text
from ctxbuild_compaction.adapters.blobstore import BlobStore
from ctxbuild_compaction.app import Compaction, Summarizers, in_loop
from ctxbuild_compaction.domain import (
    Checkpoint,
    FoldOutcome,
    InLoopSettings,
    count_groups,
    extractive_summary,
    finish_in_loop,
    group_rows,
    orphans,
    plan_in_loop,
    summary_of_row,
    summary_row,
)
from ctxbuild_compaction.handlers import Handlers
from ctxbuild_platform import contracts
from ctxbuild_platform.errors import InvalidPayload

from tests.support.compaction import MemoryBlobs, NoHistory, in_loop_turn, typed, untimed

W = 16_000
TRIGGER = compaction_budget(W).trigger
FIXED = 350


def text_row(mid, role, text="hi"):
    return {"id": mid, "role": role, "parts": [{"type": "text", "text": text}]}


def call_row(mid, *ids, turn="t"):
    return {"id": mid, "role": "assistant", "turnId": turn,
            "parts": [{"type": "tool-call", "toolCallId": c, "toolName": "read_file", "input": {"n": c}} for c in ids]}


def result_row(mid, cid, text="ok", turn="t", offload_uri=None):
    part = {"type": "tool-result", "toolCallId": cid, "toolName": "read_file",
            "output": {"type": "text", "value": text}}
    if offload_uri:
        part["offload"] = {"mode": "offloaded", "uri": offload_uri, "totalChars": 8_000, "totalLines": 100}
    return {"id": mid, "role": "tool", "turnId": turn, "parts": [part]}


# ---------- grouping ----------

def test_sys_u_a_t_t_u_a_is_four_turns():
    rows = [text_row("s", "system"), text_row("u1", "user"), call_row("a1", "c1", "c2"),
            result_row("t1", "c1"), result_row("t2", "c2"), text_row("u2", "user"), text_row("a2", "assistant")]
    assert count_groups(rows) == 4
    assert group_rows(rows) == ([0], [[1], [2, 3, 4], [5], [6]])


def test_a_group_stays_open_until_every_call_is_answered():
    rows = [text_row("u1", "user"), call_row("a1", "c1"), text_row("ui", "user", "(while the tool ran)"),
            result_row("t1", "c1"), text_row("a2", "assistant")]
    assert group_rows(rows)[1] == [[0], [1, 2, 3], [4]]
    assert orphans(rows) == {"calls": [], "results": []}
    assert orphans(rows[2:]) == {"calls": [], "results": ["c1"]}
    assert orphans(rows[:2]) == {"calls": ["c1"], "results": []}


# ---------- the memoised loop ----------

PAGE = "".join(f"2026-11-29T10:00:{i % 60:02d}.000Z INFO api-{i % 8} GET /v1/items/{i} 200 latency_ms={i % 97}.5\n"
               for i in range(110))  # ≈ 8,000 chars, a read_file page


class Recorder:
    """Stands in for a summarizer: records each fold request and answers a fixed-size summary."""

    def __init__(self):
        self.requests = []

    def __call__(self, fold):
        self.requests.append(fold)
        n = len(self.requests)
        return FoldOutcome("extractive", summary=f"fold {n}: " + extractive_summary(fold.previous_summary,
                                                                                     fold.input_rows(), 1_500),
                           input_tokens=count_messages(fold.input_rows()), calls=1)


def read_loop(steps, summarize, *, trim=True, memo=True):
    """A turn that reads one page per step, as the runner drives it: plan → (fold) → serve → step."""
    messages = [text_row("u1", "user", "Read service.log page by page and tell me what is unusual.")]
    ck = Checkpoint()
    served_log = []
    for step in range(1, steps + 1):
        plan = plan_in_loop(messages, 0, ck if memo else Checkpoint(), InLoopSettings(W, fixed_tokens=FIXED),
                            turn_id="t", step=step)
        if plan.fold is not None:
            plan, _ = finish_in_loop(plan, summarize(plan.fold))
        ck = plan.checkpoint
        served = plan.served
        served_log.append((plan.decision, served))
        tokens = FIXED + count_messages(served)
        call = call_row(f"a{step}", f"c{step}")
        call["usage"] = {"inputTokens": tokens, "outputTokens": count_messages([call])}
        part = {"type": "tool-result", "toolCallId": f"c{step}", "toolName": "read_file",
                "output": {"type": "text", "value": f"page {step}\n" + PAGE}}
        if trim:
            part = trim_inflight(part, 4_800, lambda blob: vfs_uri(blob.sha256))
        messages += [call, {"id": f"t{step}", "role": "tool", "turnId": "t", "parts": [part]}]
    return served_log, messages


def test_zero_summarizer_calls_while_the_candidate_fits():
    rec = Recorder()
    log, _ = read_loop(12, rec)
    assert rec.requests == []
    assert all(d["status"] == "serve" and d["summarizerCalls"] == 0 for d, _ in log)


def test_every_served_request_fits_and_no_tool_pair_is_split():
    rec = Recorder()
    log, _ = read_loop(20, rec, trim=False)
    assert len(rec.requests) >= 3
    for d, served in log:
        assert FIXED + count_messages(served) <= TRIGGER, d
        assert orphans(served) == {"calls": [], "results": []}


def test_second_fold_input_is_the_first_fold_plus_the_increment():
    """Finding #4: the second in-loop fold summarizes [first fold, +new], never the history again."""
    rec = Recorder()
    log, messages = read_loop(20, rec, trim=False)
    folds = [d for d, _ in log if d["status"] == "compacted"]
    first, second = rec.requests[0], rec.requests[1]
    first_ids = {r["id"] for r in first.rows}
    assert first.previous_summary is None
    assert second.previous_summary is not None and second.previous_summary.startswith("fold 1: ")
    assert first_ids.isdisjoint(r["id"] for r in second.rows)
    # the increment is exactly the rows between the two boundaries, in order
    ids = [m["id"] for m in messages]
    start, end = folds[0]["consumedCount"], folds[1]["consumedCount"]
    assert [r["id"] for r in second.rows] == ids[start:end]
    assert folds[1]["foldInput"] == {"previousSummaryId": f"compaction:{first.rows[-1]['id']}", "prefixIds": [],
                                     "rowIds": ids[start:end]}
    # O(increment): every fold's input stays far below the history it stands for
    history_tokens = count_messages(messages)
    assert all(d["summarizerInputTokens"] < history_tokens / 3 for d in folds)


def test_memo_off_refolds_the_history_every_step():
    on, off = Recorder(), Recorder()
    read_loop(20, on, trim=False)
    read_loop(20, off, trim=False, memo=False)
    tokens_on = sum(count_messages(f.input_rows()) for f in on.requests)
    tokens_off = sum(count_messages(f.input_rows()) for f in off.requests)
    assert len(off.requests) > len(on.requests)
    assert tokens_on / tokens_off <= 0.30


def test_summary_of_summary_and_the_pinned_task():
    rec = Recorder()
    log, _ = read_loop(20, rec, trim=False)
    task, row = log[-1][1][0], log[-1][1][1]
    assert task == text_row("u1", "user", "Read service.log page by page and tell me what is unusual.")
    assert row["id"].startswith("compaction:t") and row["role"] == "user"
    assert len(rec.requests) >= 3
    summary = summary_of_row(row)
    assert summary.startswith(f"fold {len(rec.requests)}: Summary of the conversation before that:\n")
    assert summary.count("earlier points omitted") <= 1 and len(summary) <= 1_600
    # the archived outputs are no longer listed one by one: a fold's transcript stands for them (SPEC §15.2)
    assert "fs_read tool at:" not in row["parts"][0]["text"]


def test_usage_estimate_only_when_the_row_was_served_after_the_checkpoint():
    rows = [text_row("u1", "user"), call_row("a1", "c1"), result_row("t1", "c1")]
    rows[1]["usage"] = {"inputTokens": 9_000, "outputTokens": 10}
    s = InLoopSettings(W, fixed_tokens=FIXED)
    plan = plan_in_loop(rows, 0, Checkpoint(), s, turn_id="t")
    assert plan.decision["estimate"] == "usage"
    assert plan.decision["estimatedTokens"] == 9_010 + count_messages(rows[2:])
    # a row of another turn, or one served before the checkpoint was made, does not cover this candidate
    assert plan_in_loop(rows, 0, Checkpoint(), s, turn_id="other").decision["estimate"] == "count"
    ck = Checkpoint(0, [], message_count=3)
    counted = plan_in_loop(rows, 0, ck, s, turn_id="t").decision
    assert counted["estimate"] == "count" and counted["estimatedTokens"] == FIXED + count_messages(rows)


def test_nothing_to_fold_when_one_group_is_over_the_trigger():
    rows = [call_row("a1", "c1"), result_row("t1", "c1", "word " * 14_000)]
    plan = plan_in_loop(rows, 0, Checkpoint(), InLoopSettings(W), turn_id="t")
    assert plan.fold is None and plan.decision["status"] == "skipped"
    assert plan.decision["reason"] == "nothing-to-fold" and plan.served == rows


def test_off_or_unknown_window_serves_the_candidate():
    rows = [text_row("u1", "user", "word " * 20_000)]
    for settings, reason in ((InLoopSettings(None), "window-unknown"),
                             (InLoopSettings(W, compress_enabled=False), "compaction-disabled")):
        plan = plan_in_loop(rows, 0, Checkpoint(), settings)
        assert plan.fold is None and plan.decision["reason"] == reason and plan.served == rows


def test_masking_outcome_keeps_the_earlier_prefix_byte_for_byte():
    prefix = [summary_row("a0", "earlier", [], [])]
    ck = Checkpoint(2, prefix, message_count=2, folds=1)
    uri = vfs_uri("ab" * 32)
    rows = [text_row("u0", "user"), text_row("a0", "assistant"),
            *[r for i in range(1, 9) for r in (call_row(f"a{i}", f"c{i}"),
                                               result_row(f"t{i}", f"c{i}", "x" * 9_000, offload_uri=uri))]]
    plan = plan_in_loop(rows, 0, ck, InLoopSettings(8_000), turn_id="t")
    assert plan.fold is not None and plan.fold.previous_summary == "earlier"
    from ctxbuild_compaction.domain import apply_masking
    masked = apply_masking(plan.fold.rows, {})
    done, changed = finish_in_loop(plan, FoldOutcome("masking", rows=masked, fallback_from="llm", error="down"))
    assert changed and done.served[0] is prefix[0]
    assert done.checkpoint.compacted_prefix[0] == prefix[0]
    assert done.decision["status"] == "skipped" and done.decision["fallback"] == "masking"
    assert all("preview omitted" in r["parts"][0]["output"]["value"]
               for r in done.checkpoint.compacted_prefix[1:] if r["role"] == "tool")
    assert orphans(done.served) == {"calls": [], "results": []}


def test_checkpoint_payload_round_trip():
    ck = Checkpoint(12, [summary_row("a5", "s", ["x.log"], [vfs_uri("cd" * 32)])], 14, 2, ["x.log"],
                    [vfs_uri("cd" * 32)], "llm", 7)
    payload = json.loads(json.dumps(ck.to_payload()))
    assert Checkpoint.from_payload(payload) == ck
    assert Checkpoint.from_payload(None) == Checkpoint()


def test_fixed_tokens_count_toward_the_trigger():
    rows = [text_row("u1", "user", "word " * 12_000)]
    assert count_messages(rows) <= TRIGGER
    plan = plan_in_loop(rows, 0, Checkpoint(), InLoopSettings(W, fixed_tokens=count_text("word " * 1_000)))
    assert plan.decision["estimatedTokens"] > TRIGGER


# ---------- the handler: a long masking run with the checkpoint by reference (SPEC §15.1) ----------

async def masking_run(steps, store, *, through_handler=False):
    """A masking turn through the in-loop use case (or its typed handler, as ``@rpc`` serves it); each step's
    (reply, request)."""
    summarizers = Summarizers("masking", put=store.put)
    handler = Handlers(Compaction(NoHistory(), summarizers, store)).compact_in_loop
    messages = [text_row("u1", "user", "Read service.log page by page and tell me what is unusual.")]

    async def step_rows(step, reply):
        call = call_row(f"a{step}", f"c{step}")
        call["usage"] = {"inputTokens": FIXED + count_messages(reply["messages"]), "outputTokens": 20}
        part = trim_inflight({"type": "tool-result", "toolCallId": f"c{step}", "toolName": "read_file",
                              "output": {"type": "text", "value": f"page {step}\n" + PAGE}},
                             4_800, lambda blob: vfs_uri(blob.sha256))
        return [call, {"id": f"t{step}", "role": "tool", "turnId": "t", "parts": [part]}]

    return await in_loop_turn(steps, messages, step_rows, window=W, fixed=FIXED, conversation_id="conv-1",
                              turn_id="turn-1",
                              serve=(lambda req: typed("ctx.compact.in_loop", handler, req)) if through_handler
                              else (lambda req: in_loop(req, NoHistory(), summarizers, checkpoints=store)))


async def test_a_long_masking_run_keeps_its_checkpoint_by_reference():
    blobs = MemoryBlobs()
    store = BlobStore(blobs, 5.0)
    run = await masking_run(90, store)
    folds = [r for r, _ in run if r["checkpointChanged"]]
    assert len(folds) >= 3
    # the checkpoint the runner records and sends back stays small: a large prefix is a provisional blob of the turn
    assert all(len(json.dumps(r["checkpoint"])) <= content_ref.INLINE_MAX_BYTES + 2_000 for r, _ in run)
    big = [r["checkpoint"] for r in folds if content_ref.is_ref(r["checkpoint"]["compactedPrefix"])]
    assert big, "the masked prefix of a long run outgrows the inline limit"
    for ck in big:
        contracts.validate("events/InLoopFoldRecorded.json", {"turnId": "turn-1", **ck, "step": 1})
        sha = ck["compactedPrefix"]["contentRef"]["sha256"]
        assert (sha, ("turn", "turn-1"), "provisional") in blobs.refs
    # zero summarizer calls while the candidate fits; each fold only folds the increment
    assert all(r["decision"]["summarizerCalls"] == 0 for r, _ in run if not r["checkpointChanged"])
    for (r, req) in run:
        if r["checkpointChanged"]:
            assert set(r["decision"]["foldInput"]["rowIds"]).isdisjoint(
                {m["id"] for m in (req["checkpoint"] or {}).get("compactedPrefix", [])
                 if isinstance(req["checkpoint"]["compactedPrefix"], list)})
    # byte-stable: between folds each served request extends the previous one, prefix rows byte for byte
    for (prev, _), (cur, _) in itertools.pairwise(run):
        if not cur["checkpointChanged"]:
            n = len(prev["messages"])
            assert json.dumps(cur["messages"][:n]) == json.dumps(prev["messages"])
    # this replica stored every prefix it serves: no read-back while it runs the turn
    assert blobs.gets == 0


async def test_the_typed_handler_answers_what_the_use_case_answers():
    """Through the generated models (request parsed, reply dumped) a long masking run gets the same replies as from
    the use case itself; a checkpoint by reference names the same prefix (its JSON keys in the models' order)."""
    runs = []
    for through_handler in (False, True):
        blobs = MemoryBlobs()
        run = await masking_run(60, BlobStore(blobs, 5.0), through_handler=through_handler)
        for reply, _ in run:
            prefix = reply["checkpoint"]["compactedPrefix"]
            if content_ref.is_ref(prefix):
                reply["checkpoint"]["compactedPrefix"] = await content_ref.resolve(blobs, prefix, "conv-1")
                reply["checkpoint"]["size"] = prefix["contentRef"]["size"]
        runs.append([untimed(r) for r, _ in run])
    assert any("size" in r["checkpoint"] for r in runs[1])
    assert runs[1] == runs[0]


async def test_another_replica_resolves_the_referenced_checkpoint_once():
    blobs = MemoryBlobs()
    run = await masking_run(90, BlobStore(blobs, 5.0))
    reply, req = next((r, q) for r, q in reversed(run)
                      if not r["checkpointChanged"] and content_ref.is_ref(q["checkpoint"]["compactedPrefix"]))
    other = BlobStore(blobs, 5.0)
    again = [await in_loop(json.loads(json.dumps(req)), NoHistory(), Summarizers("masking"), checkpoints=other)
             for _ in range(3)]
    assert all(a["messages"] == reply["messages"] and a["checkpoint"] == req["checkpoint"] for a in again)
    assert blobs.gets == 1  # content-addressed: cached by sha256 after the first read


async def test_a_referenced_checkpoint_without_a_blob_store_is_a_typed_error():
    ref = {"contentRef": {"uri": vfs_uri("ab" * 32), "sha256": "ab" * 32, "size": 2, "mediaType": "application/json"}}
    with pytest.raises(InvalidPayload):
        await in_loop({"conversationId": "c", "turnId": "t", "messages": [],
                       "checkpoint": {"consumedCount": 0, "compactedPrefix": ref}}, NoHistory())
