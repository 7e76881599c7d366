"""The context-quality bench's pure metric functions (bench/context_metrics.py)."""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from context_metrics import (
    Corpus,
    StrategyRun,
    TokenCounter,
    add_ratios,
    best_peer,
    cache_adjusted_cost,
    common_prefix,
    extends,
    find_links,
    has_task,
    match_recorded_ids,
    orphans,
    recoverable,
    recoverable_aligned,
    strategy_metrics,
    uncut_template,
    windows,
    worst_case,
)


def words(text: str) -> int:
    """A stand-in tokenizer: one token per whitespace-separated word."""
    return len(text.split())


def call(cid: str, name: str = "bash", args: str = '{"command":"ls"}') -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


SYS = {"role": "system", "content": "be brief"}
TASK = {"role": "user", "content": "fix the bug"}
A1 = {"role": "assistant", "content": None, "tool_calls": [call("c1")]}
T1 = {"role": "tool", "tool_call_id": "c1", "content": "a b c"}


def test_request_tokens_count_every_wire_field_plus_overheads():
    t = TokenCounter(words)
    assert t.message(SYS) == 3 + 1 + 2
    # id c1 (1) + name bash (1) + arguments (1 word) + role (1) + 3
    assert t.message(A1) == 3 + 1 + 1 + 1 + 1
    assert t.message(T1) == 3 + 1 + 3 + 1
    assert t.request([SYS, TASK, A1, T1]) == 3 + 6 + (3 + 1 + 3) + 7 + 8
    assert t.message({"role": "tool", "name": "x y", "tool_call_id": "c", "content": None}) == 3 + 1 + 2 + 1


def test_task_must_be_in_a_user_message_verbatim():
    assert has_task([SYS, TASK], "fix the bug")
    assert has_task([{"role": "user", "content": "[pinned task]\nfix the bug\n"}], "fix the bug")
    assert not has_task([{"role": "assistant", "content": "fix the bug"}], "fix the bug")
    assert not has_task([{"role": "user", "content": "fix the  bug"}], "fix the bug")


def test_orphans_results_without_calls_and_calls_without_results():
    assert orphans([SYS, TASK, A1, T1]) == 0
    assert orphans([SYS, TASK, T1]) == 1  # a result whose call was dropped
    assert orphans([SYS, TASK, A1]) == 1  # a call whose result is missing at the end
    assert orphans([SYS, TASK, A1, {"role": "user", "content": "x"}, T1]) == 2  # closed by a user message
    two = {"role": "assistant", "content": None, "tool_calls": [call("c1"), call("c2")]}
    assert orphans([TASK, two, T1, {"role": "tool", "tool_call_id": "c2", "content": ""}]) == 0
    assert orphans([TASK, two, T1]) == 1


def test_prefix_is_deep_equality_of_whole_messages():
    assert common_prefix([SYS, TASK], [SYS, TASK, A1]) == 2
    assert extends([SYS, TASK], [SYS, TASK, A1])
    assert not extends([SYS, TASK, A1], [SYS, TASK])
    changed = {**T1, "content": "[cleared]"}
    assert common_prefix([SYS, TASK, A1, T1], [SYS, TASK, A1, changed]) == 3
    assert not extends([SYS, TASK, A1, T1], [SYS, TASK, A1, changed, A1])


def test_cache_adjusted_cost_prices_the_shared_prefix_at_a_tenth():
    t = TokenCounter(words)
    r1, r2 = [SYS, TASK], [SYS, TASK, A1, T1]
    n1, n2 = t.request(r1), t.request(r2)
    prefix = 3 + t.message(SYS) + t.message(TASK)
    assert prefix == n1
    assert cache_adjusted_cost([r1, r2], t) == pytest.approx(1.25 * n1 + 0.1 * prefix + 1.25 * (n2 - prefix))
    # nothing in common: all at 1.25; the strategy's own LLM tokens at 1.25
    other = [{"role": "system", "content": "other"}, TASK]
    assert cache_adjusted_cost([r1, other], t, llm_tokens=100) == pytest.approx(
        1.25 * n1 + 1.25 * t.request(other) + 125)


def test_windows_of_32_chars_and_recoverable_shares():
    text = "x" * 70
    assert [len(w) for w in windows(text)] == [32, 32, 6]
    out = hashlib.sha256(b"an output").hexdigest() + "tail!"  # 64 chars that do not repeat, then 5
    corpus = Corpus(["prefix " + out[:32] + " gap " + out[32:64] + " and tail!"])
    # aligned: the two full windows and the short tail found; sliding: the tail has no 32-char window of its own
    assert recoverable_aligned([out], corpus) == (69, 69)
    assert recoverable([out], corpus) == (64, 69)
    assert recoverable([out], Corpus([out])) == (69, 69)
    assert recoverable([out], Corpus(["nothing " + out[:31]])) == (0, 69)
    # a window straddling two corpus texts does not count
    assert recoverable([out[:32]], Corpus([out[:16], out[16:32]])) == (0, 32)
    # text quoted at another offset: found by the sliding windows, missed by the aligned ones
    quoted = Corpus([out[5:45]])
    assert recoverable([out], quoted) == (40, 69)
    assert recoverable_aligned([out], quoted) == (0, 69)
    # short outputs count when found whole
    assert recoverable(["ok", "no"], Corpus(["it is ok"])) == (2, 4)


def test_find_links_in_order_distinct():
    pat = re.compile(r"context://vfs/vfs_[0-9a-f]{16}\.txt")
    a, b = "context://vfs/vfs_0123456789abcdef.txt", "context://vfs/vfs_fedcba9876543210.txt"
    assert find_links([f"see {b} and {a}", f"again {b}"], pat) == [b, a]


def test_strategy_metrics_on_a_small_run():
    t = TokenCounter(words)
    out = "o" * 40
    T = {"role": "tool", "tool_call_id": "c1", "content": out}
    reqs = [[SYS, TASK], [SYS, TASK, A1, T], [SYS, {"role": "user", "content": "summary"}]]
    m = strategy_metrics(StrategyRun(reqs, [False, False, True], readback=[out]), task="fix the bug",
                         window=10, outputs=[out], tokens=t)
    assert m["steps"] == 3
    assert m["no_task_steps"] == 1
    assert m["orphan_steps"] == 0
    assert m["prefix_stability"] == 0.5
    assert m["prefix_stability_outside_compaction"] == 1.0
    assert m["model_recoverable"] == 1.0  # only through the read-back text
    assert m["steps_over_window"] == sum(1 for r in reqs if t.request(r) > 10)
    m2 = strategy_metrics(StrategyRun(reqs, [False, False, True]), task="fix the bug", window=10,
                          outputs=[out], tokens=t)
    assert m2["model_recoverable"] == 0.0


def test_best_peer_and_ratios():
    peers = {"raw": {"steps_over_window": 3, "no_task_steps": 0, "model_recoverable": 1.0,
                     "cache_adjusted_cost": 1000.0},
             "trim": {"steps_over_window": 0, "no_task_steps": 5, "model_recoverable": 0.1,
                      "cache_adjusted_cost": 100.0},
             "evict": {"steps_over_window": 2, "no_task_steps": 0, "model_recoverable": 0.995,
                       "cache_adjusted_cost": 600.0}}
    assert best_peer(peers) == "evict"
    s = {**{k: dict(v) for k, v in peers.items()}, "ours": {"cache_adjusted_cost": 300.0}}
    info = add_ratios(s, ["ours"])
    assert info["best_peer"] == "evict" and s["ours"]["cost_ratio_vs_best_peer"] == 0.5
    assert "cost_ratio_vs_raw" not in s["ours"]
    small = {"raw": {**peers["raw"], "steps_over_window": 0}, "ours": {"cache_adjusted_cost": 900.0}}
    add_ratios(small, ["ours"])
    assert small["ours"]["cost_ratio_vs_raw"] == 0.9 and "cost_ratio_vs_best_peer" not in small["ours"]
    none_ok = {"raw": {**peers["raw"], "model_recoverable": 0.5}, "ours": {"cache_adjusted_cost": 1.0}}
    assert add_ratios(none_ok, ["ours"])["best_peer"] is None
    assert none_ok["ours"]["cost_ratio_vs_best_peer"] is None


def test_worst_case_takes_the_bad_direction_of_each_figure():
    cells = [{"steps_over_window": 0, "no_task_steps": 0, "orphan_steps": 0, "model_recoverable": 1.0,
              "prefix_stability_outside_compaction": 1.0, "cost_ratio_vs_best_peer": 0.5},
             {"steps_over_window": 2, "no_task_steps": 0, "orphan_steps": 1, "model_recoverable": 0.9,
              "prefix_stability_outside_compaction": None, "cost_ratio_vs_raw": 1.1},
             {"steps_over_window": 1, "no_task_steps": 3, "orphan_steps": 0, "model_recoverable": 0.95,
              "prefix_stability_outside_compaction": 0.8, "cost_ratio_vs_best_peer": 0.7}]
    w = worst_case(cells)
    assert w["steps_over_window"] == 2 and w["no_task_steps"] == 3 and w["orphan_steps"] == 1
    assert w["model_recoverable"] == 0.9 and w["prefix_stability_outside_compaction"] == 0.8
    assert w["cost_ratio_vs_best_peer"] == 0.7 and w["cost_ratio_vs_best_peer_cells"] == 2
    assert w["cost_ratio_vs_raw"] == 1.1 and w["cost_ratio_vs_raw_cells"] == 1


def test_uncut_template_disables_only_the_length_cut():
    tpl = ("<returncode>{{output.returncode}}</returncode>\n{% if output.output | length < 10000 -%}\n<output>\n"
           "{{ output.output -}}\n</output>\n{%- else -%}\n<output_head>{{ output.output[:5000] }}</output_head>"
           "{%- endif -%}")
    out = uncut_template(tpl)
    assert "output.output | length < 1000000000000000" in out
    assert out.replace("1000000000000000", "10000") == tpl
    assert uncut_template("no cut here {{ output.output }}") == "no cut here {{ output.output }}"


def test_recorded_ids_follow_the_replayed_calls_in_order():
    rec = [("a", "bash", {"command": "ls"}), ("b", "bash", {"command": "cat x"}), ("c", "submit", {})]
    assert match_recorded_ids([("bash", {"command": "ls"}), ("bash", {"command": "cat x"})], rec) == ["a", "b"]
    assert match_recorded_ids([("bash", {"command": "cat x"})], rec) == ["b"]  # a dropped call is skipped
    assert match_recorded_ids([("bash", {"command": "pwd"})], rec) is None
    assert match_recorded_ids([("bash", {"command": "ls"}), ("bash", {"command": "ls"})],
                              [("a", "bash", {"command": "ls"}), ("a", "bash", {"command": "ls"})]) is None
