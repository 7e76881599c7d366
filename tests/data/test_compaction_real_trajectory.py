"""In-loop compaction on real material: the mini-swe-agent run in ../shared/data (80 model calls, full bash
outputs from ``extra.raw_output`` through the in-flight lane) replayed under a 32k window, one in-loop decision per
step with the offline extractive summarizer (real tokenizer, codec and sumy).

Every served request stays under the trigger, no tool call is ever separated from its result, the fold is
memoised (almost every prompt is a byte-prefix extension of the previous one), and each fold's summarizer input is
the increment only."""

from __future__ import annotations

import json

import pytest
from ctxbuild_codec import compaction_budget, inflight_threshold, trim_inflight, vfs_uri
from ctxbuild_codec.tokens import count_messages, count_text
from ctxbuild_compaction.app import ExtractiveSummarizer, MaskingSummarizer, fold_with_fallback
from ctxbuild_compaction.domain import Checkpoint, InLoopSettings, finish_in_loop, orphans, plan_in_loop

pytestmark = [pytest.mark.shared_data]

TRAJECTORY = "trajectories/03_miniswe_deepseek-chat_sqlfluff-1733.traj.json"
WINDOW = 32_000


def steps_of(path):
    msgs = json.loads(path.read_text())["messages"]
    system = next(m["content"] for m in msgs if m["role"] == "system")
    head, steps = [], []
    for n, m in enumerate(msgs):
        if m["role"] == "user" and not steps:
            head.append({"id": f"m{n}", "role": "user", "parts": [{"type": "text", "text": m["content"]}]})
        elif m["role"] == "assistant":
            parts = [{"type": "text", "text": m["content"]}] if m.get("content") else []
            parts += [{"type": "tool-call", "toolCallId": c["id"], "toolName": c["function"]["name"],
                       "input": json.loads(c["function"]["arguments"] or "{}")} for c in m.get("tool_calls") or []]
            steps.append([{"id": f"m{n}", "role": "assistant", "turnId": "traj", "parts": parts}])
        elif m["role"] == "tool" and steps:
            full = (m.get("extra") or {}).get("raw_output") or m["content"]
            steps[-1].append({"id": f"m{n}", "role": "tool", "turnId": "traj", "parts": [
                {"type": "tool-result", "toolCallId": m["tool_call_id"], "toolName": "bash",
                 "output": {"type": "text", "value": full}}]})
        elif m["role"] == "user":
            steps[-1].append({"id": f"m{n}", "role": "user", "parts": [{"type": "text", "text": m["content"]}]})
    return system, head, steps


async def test_trajectory_replayed_under_a_32k_window(shared_data):
    system, head, steps = steps_of(shared_data / TRAJECTORY)
    assert len(steps) == 80
    fixed = count_text(system) + 200
    trigger = compaction_budget(WINDOW).trigger
    threshold = inflight_threshold(None, WINDOW)
    messages, ck, prev = list(head), Checkpoint(), None
    prefix_ext, folds = [], []
    for rows in steps:
        plan = plan_in_loop(messages, 0, ck, InLoopSettings(WINDOW, fixed_tokens=fixed), turn_id="traj")
        if plan.fold is not None:
            fold = plan.fold
            plan, changed = finish_in_loop(plan, await fold_with_fallback(ExtractiveSummarizer(), fold,
                                                                          MaskingSummarizer()))
            assert changed and plan.decision["status"] == "compacted"
            folds.append((fold, plan.checkpoint))
        ck = plan.checkpoint
        served = plan.served
        tokens = fixed + count_messages(served)
        assert tokens <= trigger
        assert orphans(served) == {"calls": [], "results": []}
        cur = [json.dumps(m, ensure_ascii=False) for m in served]
        if prev is not None:
            prefix_ext.append(cur[: len(prev)] == prev)
        prev = cur
        assistant = {**rows[0], "usage": {"inputTokens": tokens, "outputTokens": count_messages(rows[:1])}}
        rest = [{**r, "parts": [trim_inflight(r["parts"][0], threshold, lambda b: vfs_uri(b.sha256))]}
                if r["role"] == "tool" else r for r in rows[1:]]
        messages += [assistant, *rest]
    assert count_messages(messages) > trigger and folds
    assert sum(prefix_ext) / len(prefix_ext) >= 0.95
    # memoised: each fold takes the rows after the previous one, never the history again; the task (the run's
    # first user message) is pinned, never folded, and stays verbatim at the head of every later request
    consumed = 0
    for fold, checkpoint in folds:
        ids = [m["id"] for m in messages]
        assert checkpoint.task_id == head[-1]["id"]
        assert [r["id"] for r in fold.rows] == [i for i in ids[consumed:checkpoint.consumed_count]
                                               if not i.startswith("sys") and i != checkpoint.task_id]
        consumed = checkpoint.consumed_count
    assert json.loads(prev[0]) == head[-1]
