"""The chaos suite's checker (tests/support/chaos.py) and report (bench/chaos.py) on hand-made turns: each way a
faulted turn can differ from its fault-free run is counted, and the report fails on any of them."""

from __future__ import annotations

from bench.chaos import report
from tests.support.chaos import call_key, check_turn, request_tokens, with_stamps


def ev(kind: str, **data) -> dict:
    return {"type": kind, "data": data}


def turn(prefix: str, steps: int = 2, end: str = "TurnCompleted") -> list[dict]:
    out = [ev("TurnQueued", turnId=prefix), ev("TurnStarted")]
    for k in range(1, steps + 1):
        out.append(ev("StepServed", step=k))
        if k < steps:
            cid = f"call_{prefix}_{k}_1"
            out += [ev("ToolCallRequested", toolCallId=cid, step=k), ev("ToolResultRecorded", toolCallId=cid, step=k)]
    return [*out, ev(end)]


def req(*parts_per_message: list[dict], text: str = "hi") -> dict:
    return {"system": "sys", "tools": [], "messages": [{"role": "user", "parts": [{"type": "text", "text": text}]},
                                                      *({"role": "assistant", "parts": p} for p in parts_per_message)]}


def test_call_ids_compare_without_the_turns_prefix():
    assert call_key("call_ab12cd_7_2") == "7_2" == call_key("call_ff00ee_7_2")


def test_a_faithful_resumed_turn_passes():
    base, got = turn("aaaa", 3), turn("bbbb", 3)
    got.insert(4, ev("TurnResumed"))  # a resume is not a lost or duplicated fact
    v = check_turn(base, got, {1: req(), 2: req()}, 1000, {"n/1": 1})
    assert v.ok and v.steps == 2, v.symptoms


def test_stuck_lost_duplicated_failed_and_rerun_are_each_counted():
    base = turn("aaaa", 3)
    assert check_turn(base, None, {}, 1000, {}).stuck == 1
    lost = [e for e in turn("bbbb", 3) if not (e["type"] == "StepServed" and e["data"]["step"] == 3)]
    assert check_turn(base, lost, {}, 1000, {}).lost == 1
    twice = turn("bbbb", 3)
    twice.insert(5, dict(twice[4]))  # ToolResultRecorded of step 1 twice
    v = check_turn(base, twice, {}, 1000, {})
    assert v.duplicates == 1 and v.duplicate_tool_runs == 1
    failed = [*turn("bbbb", 3)[:-1], ev("TurnFailed")]
    assert check_turn(base, failed, {}, 1000, {}, error={"code": "unavailable", "message": "x"}).bad_terminal == 1
    assert check_turn(base, turn("bbbb", 3), {}, 1000, {"n/1": 2, "n/2": 1}).duplicate_tool_runs == 1


def test_orphans_and_over_window_in_served_requests():
    base = turn("aaaa", 2)
    orphan = req([{"type": "tool-call", "toolCallId": "c1", "toolName": "x", "input": {}}])
    assert check_turn(base, turn("bbbb", 2), {1: orphan}, 1000, {}).orphans == 1
    big = req(text="word " * 3000)
    assert request_tokens(big) > 1000
    assert check_turn(base, turn("bbbb", 2), {1: big}, 1000, {}).over_window == 1


def test_stamps_go_to_every_tool_step():
    script = [{"toolCalls": [{"toolName": "bash", "input": {}, "output": {"type": "text", "value": "ok"}}]},
              {"text": "done"}]
    out = with_stamps(script, "mcp__chaosctr__stamp_x", "n", 250)
    assert out[0]["toolCalls"][-1] == {"toolName": "mcp__chaosctr__stamp_x", "input": {"key": "n/1", "delay_ms": 250}}
    assert out[1] == {"text": "done"} and len(script[0]["toolCalls"]) == 1


def row(fault: str, **kw) -> dict:
    base = {"fault": fault, "injections": [{"afterStep": 1, "midTurn": True, "outage_s": 1}] * 3, "turns": 2,
            "stuck": 0, "lost": 0, "duplicates": 0, "bad_terminal": 0, "duplicate_tool_runs": 0, "over_window": 0,
            "orphans": 0, "passed": True, "symptoms": []}
    return {**base, **kw}


FAULTS = ["truncation", "persistence", "blobstore", "compaction", "mcp_catalog", "runner", "nats", "postgres", "s3",
          "poison"]


def test_the_report_holds_only_when_every_figure_does():
    ok = report({"faults": [row(f) for f in FAULTS], "tests": {}, "baseline": {}})
    assert ok["ok"] and ok["faults_injected"] == 30 and ok["turns_stuck"] == 0
    late = report({"faults": [row(f) for f in FAULTS[:-1]] + [row("poison", injections=[
        {"afterStep": 1, "midTurn": False, "outage_s": 0}] * 3)], "tests": {}, "baseline": {}})
    assert not late["ok"] and late["faults_injected"] == 27  # an injection after the turn ended does not count
    stuck = report({"faults": [row(f) for f in FAULTS[1:]] + [row("truncation", stuck=1, passed=False)],
                    "tests": {}, "baseline": {}})
    assert not stuck["ok"] and stuck["turns_stuck"] == 1
    failed = report({"faults": [row(f) for f in FAULTS], "tests": {"t::x": "failed"}, "baseline": {}})
    assert not failed["ok"]
    missing = report({"faults": [row(f) for f in FAULTS[:-1]], "tests": {}, "baseline": {}})
    assert not missing["ok"] and missing["faults_missing"] == ["poison"]
