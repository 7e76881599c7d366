"""The chaos suite's harness (tests/chaos): real replayed turns on a private stack, faults injected at random points
of them, and the checker that compares each faulted turn with a fault-free run of the same script.

The checker's verdict per turn (pure: :func:`check_turn`, unit-tested in tests/unit/test_chaos_checker.py):

- ``stuck``: the turn has no terminal event once its faults are over (a bounded wait, not a timing assertion);
- ``terminal``: exactly one terminal event, and TurnCompleted like the fault-free run;
- ``lost``: keyed events of the fault-free run missing from the faulted one — StepServed per step,
  ToolCallRequested / ToolResultRecorded per call (``<step>_<i>``, the turn's call-id prefix dropped), the terminal
  event; ``duplicates``: a keyed event present more than once (retries and resumes must not repeat a fact);
- ``duplicate_tool_runs``: a real tool run (the counting MCP server's ledger, one line per run) repeated, plus a
  tool result recorded twice;
- ``orphans``: tool calls without a result (or results without a call) in any served request
  (``bench.e2e_metrics.orphans``);
- ``over_window``: served requests whose tokens (cl100k, the product's counter: messages + system + tools as sent)
  exceed the conversation's context window.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import httpx
from ctxbuild_codec.tokens import count_messages, count_text

from bench.e2e_metrics import orphans

SEED = int(os.environ.get("CTX_CHAOS_SEED", "1616"))
WINDOW = 16_000  # small: truncation and compaction both act on the replayed turns
STAMP_SERVER = "chaosctr"
# the run's record: every injection and verdict (tests/chaos/conftest.py writes it to $CTX_CHAOS_OUT)
RECORD: dict[str, Any] = {"seed": SEED, "window": WINDOW, "faults": [], "tests": {}, "started": None}
TERMINAL = ("TurnCompleted", "TurnFailed")
KEYED = ("StepServed", "ToolCallRequested", "ToolResultRecorded", *TERMINAL)


# ---------------------------------------------------------------- pure checks

def call_key(tool_call_id: str) -> str:
    """``call_<turn piece>_<step>_<i>`` → ``<step>_<i>`` (the runner prefixes each turn's ids)."""
    parts = tool_call_id.rsplit("_", 2)
    return "_".join(parts[-2:]) if len(parts) == 3 else tool_call_id


def event_key(event: Mapping[str, Any]) -> tuple[str, str] | None:
    kind, data = event["type"], event.get("data") or {}
    if kind == "StepServed":
        return kind, str(data.get("step"))
    if kind in ("ToolCallRequested", "ToolResultRecorded"):
        return kind, call_key(str(data.get("toolCallId")))
    if kind in TERMINAL:
        return "terminal", ""
    return None


def keyed(events: Iterable[Mapping[str, Any]]) -> Counter[tuple[str, str]]:
    return Counter(k for e in events if (k := event_key(e)) is not None)


def request_tokens(request: Mapping[str, Any]) -> int:
    """Tokens of a served request as the provider receives it: messages (the product's counter), the system
    prompt, and the tools' JSON."""
    system = request.get("system")
    tools = request.get("tools") or []
    return (count_messages(list(request.get("messages") or []))
            + (count_text(system) if isinstance(system, str) else count_text(json.dumps(system)) if system else 0)
            + (count_text(json.dumps(tools, ensure_ascii=False, separators=(",", ":"))) if tools else 0))


@dataclass
class Verdict:
    stuck: int = 0
    lost: int = 0
    duplicates: int = 0
    duplicate_tool_runs: int = 0
    orphans: int = 0
    over_window: int = 0
    bad_terminal: int = 0
    follow_failures: int = 0  # the CLI's event follow did not end on the terminal event with every event once
    steps: int = 0
    # diagnostics, not failures: tool results that read as errors where the fault-free run's did not (a tool call
    # lost to the fault and answered "[Error: …]"), and the longest pause between two events of a turn
    degraded_results: int = 0
    longest_pause_s: float = 0.0
    symptoms: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.stuck or self.lost or self.duplicates or self.duplicate_tool_runs or self.orphans
                    or self.over_window or self.bad_terminal or self.follow_failures)

    def add(self, other: Verdict) -> None:
        for name in ("stuck", "lost", "duplicates", "duplicate_tool_runs", "orphans", "over_window",
                     "bad_terminal", "follow_failures", "steps", "degraded_results"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.longest_pause_s = max(self.longest_pause_s, other.longest_pause_s)
        self.symptoms.extend(other.symptoms)


def longest_pause(events: Sequence[Mapping[str, Any]]) -> float:
    """The longest time between two consecutive events of a turn (recordedAt), in seconds."""
    from datetime import datetime

    stamps = [datetime.fromisoformat(e["recordedAt"]) for e in events if e.get("recordedAt")]
    return round(max(((b - a).total_seconds() for a, b in pairwise(stamps)), default=0.0), 1)


def check_turn(baseline: Sequence[Mapping[str, Any]], events: Sequence[Mapping[str, Any]] | None,
               requests: Mapping[int, Mapping[str, Any]], window: int, tool_runs: Mapping[str, int],
               label: str = "turn", error: Mapping[str, Any] | None = None) -> Verdict:
    """A faulted turn's events (None: never reached a terminal event) against its fault-free run's; its served
    requests by step; the tool runs the ledger counted for it (key → runs)."""
    v = Verdict()
    if events is None:
        v.stuck = 1
        v.symptoms.append(f"{label}: no terminal event (stuck)")
        return v
    ends = [e["type"] for e in events if e["type"] in TERMINAL]
    want = [e["type"] for e in baseline if e["type"] in TERMINAL]
    if ends != want:
        v.bad_terminal = 1
        why = f" ({error.get('code')}: {str(error.get('message'))[:160]})" if error else ""
        v.symptoms.append(f"{label}: terminal events {ends}, fault-free run {want}{why}")
    got, ref = keyed(events), keyed(baseline)
    lost = sorted(k for k in ref if got[k] == 0 and k[0] != "terminal")
    if lost:
        v.lost = len(lost)
        v.symptoms.append(f"{label}: {len(lost)} event(s) of the fault-free run missing, e.g. "
                          f"{[':'.join(k) for k in lost[:4]]}")
    dup = sorted(k for k, n in got.items() if n > 1)
    if dup:
        v.duplicates = sum(got[k] - 1 for k in dup)
        v.symptoms.append(f"{label}: event(s) recorded more than once: {[':'.join(k) for k in dup[:4]]}")
    results_twice = sum(n - 1 for (kind, _), n in got.items() if kind == "ToolResultRecorded" and n > 1)
    reruns = sum(n - 1 for n in tool_runs.values() if n > 1)
    if reruns:
        v.symptoms.append(f"{label}: {reruns} tool run(s) repeated: "
                          f"{sorted(k for k, n in tool_runs.items() if n > 1)[:4]}")
    v.duplicate_tool_runs = reruns + results_twice
    errors = {call_key(str(e["data"].get("toolCallId"))) for e in events if e["type"] == "ToolResultRecorded"
              and str((e["data"].get("output") or {}).get("type", "")).startswith("error")}
    ref_errors = {call_key(str(e["data"].get("toolCallId"))) for e in baseline if e["type"] == "ToolResultRecorded"
                  and str((e["data"].get("output") or {}).get("type", "")).startswith("error")}
    degraded = sorted(errors - ref_errors)
    if degraded:
        v.degraded_results = len(degraded)
        first = next(e for e in events if e["type"] == "ToolResultRecorded"
                     and call_key(str(e["data"].get("toolCallId"))) == degraded[0])
        v.symptoms.append(f"{label} (diagnostic): {len(degraded)} tool result(s) became errors, e.g. call "
                          f"{degraded[0]}: {str(first['data']['output'].get('value'))[:160]}")
    v.longest_pause_s = longest_pause(events)
    v.steps = len(requests)
    for step, req in sorted(requests.items()):
        o = orphans(req.get("messages") or [])
        if o["calls"] or o["results"]:
            v.orphans += len(o["calls"]) + len(o["results"])
            v.symptoms.append(f"{label}: step {step} served orphans {o}")
        tokens = request_tokens(req)
        if tokens > window:
            v.over_window += 1
            v.symptoms.append(f"{label}: step {step} served {tokens} tokens > window {window}")
    return v


# ---------------------------------------------------------------- scripts

def with_stamps(script: Sequence[Mapping[str, Any]], stamp_tool: str, nonce: str, delay_ms: int = 0
                ) -> list[dict[str, Any]]:
    """The recorded script with a real, counted tool call (``stamp``, taking ``delay_ms``) added to every step that
    calls tools: those run for real through the MCP catalog (no recorded output), so a repeated run is visible, and
    the delay makes the turn last long enough for its faults."""
    out: list[dict[str, Any]] = []
    for k, step in enumerate(script, start=1):
        step = dict(step)
        calls = list(step.get("toolCalls") or [])
        if calls:
            calls.append({"toolName": stamp_tool, "input": {"key": f"{nonce}/{k}", "delay_ms": delay_ms}})
            step["toolCalls"] = calls
        out.append(step)
    return out


# ---------------------------------------------------------------- talking to the edge through faults

class Edge:
    """The orchestration API, called through faults: transport errors and 5xx are retried until ``patience``."""

    def __init__(self, base: Callable[[], str], headers: dict[str, str], patience: float = 240.0) -> None:
        self.base, self.headers, self.patience = base, headers, patience

    def call(self, method: str, path: str, *, ok: Iterable[int] = (200,), **kw: Any) -> httpx.Response:
        deadline = time.monotonic() + self.patience
        last = ""
        while True:
            try:
                r = httpx.request(method, self.base() + path, headers=self.headers, timeout=30, **kw)
                if r.status_code in ok:
                    return r
                last = f"HTTP {r.status_code} {r.text[:300]}"
                if r.status_code < 500 and r.status_code != 429:
                    raise AssertionError(f"{method} {path}: {last}")
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                raise AssertionError(f"{method} {path} kept failing for {self.patience:.0f}s: {last}")
            time.sleep(0.25)

    def conversation(self, title: str, settings: dict[str, Any]) -> str:
        return self.call("POST", "/v1/conversations", ok=(201, 200),
                         json={"title": title, "settings": settings}).json()["id"]

    def start_turn(self, cid: str, text: str, provider: dict[str, Any], max_steps: int) -> str:
        return self.call("POST", f"/v1/conversations/{cid}/turns", ok=(202,),
                         json={"text": text, "provider": provider, "maxSteps": max_steps}).json()["turnId"]

    def turn(self, cid: str, tid: str) -> dict[str, Any]:
        return self.call("GET", f"/v1/conversations/{cid}/turns/{tid}").json()

    def served(self, cid: str, tid: str) -> tuple[bool, int]:
        evs = self.turn(cid, tid)["events"]
        return any(e["type"] in TERMINAL for e in evs), sum(e["type"] == "StepServed" for e in evs)

    def wait_steps(self, cid: str, tid: str, n: int, timeout: float) -> bool:
        """Until the turn has served ``n`` steps or ended; whether it is still running."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done, steps = self.served(cid, tid)
            if done:
                return False
            if steps >= n:
                return True
            time.sleep(0.05)
        return True

    def wait_terminal(self, cid: str, tid: str, timeout: float) -> dict[str, Any] | None:
        """The turn log once it has a terminal event; None if it has none within ``timeout`` (stuck)."""
        deadline = time.monotonic() + timeout
        while True:
            log = self.turn(cid, tid)
            if any(e["type"] in TERMINAL for e in log["events"]):
                return log
            if time.monotonic() > deadline:
                return None
            time.sleep(0.25)

    def requests(self, cid: str, events: Sequence[Mapping[str, Any]]) -> dict[int, dict[str, Any]]:
        """Each served step's request, as the model saw it."""
        tid = next(e["data"]["turnId"] for e in events if e["type"] == "TurnQueued")
        out: dict[int, dict[str, Any]] = {}
        for e in events:
            if e["type"] == "StepServed" and e["data"].get("request"):
                k = e["data"]["step"]
                out[k] = self.call("GET", f"/v1/conversations/{cid}/turns/{tid}/steps/{k}/request").json()
        return out
