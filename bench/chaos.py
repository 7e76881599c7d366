"""`make test-chaos`'s report: the chaos suite's record (tests/chaos writes it to $CTX_CHAOS_OUT: every injection and
the checker's verdict per fault) → bench/results/chaos.json, and the exit code that makes it a real check.

Figures (all over the run):
- ``faults_injected``: injections that landed while their turn was running (an injection after the turn had already
  ended is listed but not counted); must be ≥ 30 (nine faults × 3 plus 3 poison messages);
- ``turns_stuck``: turns with no terminal event once their faults were over;
- ``events_lost``: keyed events (StepServed per step, ToolCallRequested / ToolResultRecorded per call, the terminal
  event) of the fault-free run of the same script missing from the faulted run, plus turns whose terminal event is
  not the fault-free run's single TurnCompleted (a failed turn loses its answer), plus keyed events recorded twice;
- ``duplicate_tool_runs``: real tool runs repeated (the counting MCP server's ledger) plus tool results recorded twice;
- ``over_window_steps``: served requests over the conversation's context window; ``orphan_tool_calls`` likewise;
  (``events_lost`` also counts turns whose persisted history is not whole: a message twice, fewer assistant/tool
  messages than the script's model calls/tool steps, an orphan — bench.e2e_metrics.history_problems);
and per fault the same, with its symptoms. Exit 1 unless faults_injected ≥ 30, every other figure is 0, every
fault's test passed and the fault-free reference is whole.

    .venv/bin/python bench/chaos.py <record.json> --out bench/results/chaos.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

MIN_FAULTS = 30
FAULT_ORDER = ["truncation", "persistence", "blobstore", "compaction", "mcp_catalog", "runner", "nats", "postgres",
               "s3", "poison"]


def report(record: dict[str, Any]) -> dict[str, Any]:
    rows = sorted(record.get("faults") or [], key=lambda r: (FAULT_ORDER.index(r["fault"])
                                                              if r["fault"] in FAULT_ORDER else 99))
    per: list[dict[str, Any]] = []
    for r in rows:
        landed = [i for i in r.get("injections") or [] if i.get("midTurn")]
        per.append({
            "fault": r["fault"], "trajectory": r.get("trajectory"),
            "injections": len(landed), "injectionsAfterTheTurnEnded": len(r.get("injections") or []) - len(landed),
            "turns": r.get("turns", 0), "stuck": r.get("stuck", 0),
            "lost": r.get("lost", 0) + r.get("bad_terminal", 0) + r.get("duplicates", 0),
            "duplicate_tool_runs": r.get("duplicate_tool_runs", 0), "over_window": r.get("over_window", 0),
            "orphans": r.get("orphans", 0), "steps_checked": r.get("steps_checked", 0),
            "cli_follow_failures": r.get("cli_follow_failures", 0),
            "degraded_tool_results": r.get("degraded_results", 0), "longest_pause_s": r.get("longest_pause_s"),
            "passed": bool(r.get("passed")), "seconds": r.get("seconds"),
            "points": [{k: i.get(k) for k in ("afterStep", "midTurn", "outage_s")} for i in r.get("injections") or []],
            "symptoms": r.get("symptoms") or [],
            **({"poison": r["poison"]} if "poison" in r else {}),
        })
    failed_tests = sorted(k for k, v in (record.get("tests") or {}).items() if v not in ("passed", "skipped"))
    base = record.get("baseline") or {}
    doc = {
        "faults_injected": sum(p["injections"] for p in per),
        "turns_stuck": sum(p["stuck"] for p in per),
        "events_lost": sum(p["lost"] for p in per),
        "duplicate_tool_runs": sum(p["duplicate_tool_runs"] for p in per),
        "over_window_steps": sum(p["over_window"] for p in per),
        "orphan_tool_calls": sum(p["orphans"] for p in per),
        "turns": sum(p["turns"] for p in per),
        "faults": {p["fault"]: p for p in per},
        "faults_missing": [f for f in FAULT_ORDER if f not in {p["fault"] for p in per}],
        "failed_tests": failed_tests,
        "fault_free_reference": base,
        "seed": record.get("seed"), "window": record.get("window"),
        "suite_seconds": record.get("seconds"), "started": record.get("started"), "finished": record.get("finished"),
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "command": "make test-chaos (pytest -m chaos tests/chaos)",
    }
    doc["ok"] = (doc["faults_injected"] >= MIN_FAULTS and not any(
        doc[k] for k in ("turns_stuck", "events_lost", "duplicate_tool_runs", "over_window_steps",
                         "orphan_tool_calls")) and not failed_tests and not doc["faults_missing"]
        and all(p["passed"] for p in per) and not (base.get("orphans") or base.get("over_window")
                                                    or base.get("bad_terminal") or base.get("history_problems")))
    return doc


def table(doc: dict[str, Any]) -> str:
    head = f"{'fault':<12} {'inj':>3} {'turns':>5} {'stuck':>5} {'lost':>4} {'dupRun':>6} {'overWin':>7} " \
           f"{'orph':>4} {'degr':>4} {'pause':>6} {'secs':>5}  result"
    lines = [head]
    for p in doc["faults"].values():
        lines.append(f"{p['fault']:<12} {p['injections']:>3} {p['turns']:>5} {p['stuck']:>5} {p['lost']:>4} "
                     f"{p['duplicate_tool_runs']:>6} {p['over_window']:>7} {p['orphans']:>4} "
                     f"{p['degraded_tool_results']:>4} {p['longest_pause_s'] or 0:>6} {p['seconds'] or 0:>5}  "
                     f"{'pass' if p['passed'] else 'FAIL'}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("record", type=Path)
    parser.add_argument("--out", type=Path, default=Path("bench/results/chaos.json"))
    args = parser.parse_args()
    if not args.record.is_file():
        print(f"chaos: no record at {args.record} (the suite did not run: shared data absent or start-up failed)",
              file=sys.stderr)
        return 1
    record = json.loads(args.record.read_text())
    if record.get("skipped") == "shared data absent":  # like every shared_data test: a clean skip, said so
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"skipped": "shared data absent (../shared/data/trajectories)"}) + "\n")
        print("chaos: skipped, shared data absent")
        return 0
    doc = report(record)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(table(doc))
    print(f"chaos: {doc['faults_injected']} faults injected, {doc['turns_stuck']} turns stuck, "
          f"{doc['events_lost']} events lost, {doc['duplicate_tool_runs']} duplicate tool runs, "
          f"{doc['over_window_steps']} steps over the window → {args.out}"
          + ("" if doc["ok"] else "  [FAIL]"))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
