"""Pure metric functions of the end-to-end bench (bench/e2e.py): served requests, turn events and persisted
messages in, figures out. No I/O here (unit-tested in tests/unit/test_bench_e2e_metrics.py).

Definitions (also written into bench/results/e2e.json):

- prefix stability: for consecutive steps k-1 → k of one turn with no compaction at step k (no
  CompactionDecided / InLoopFoldRecorded carrying ``step == k``), request k is a byte-prefix extension of request
  k-1: system and tools byte-equal, and request k's messages start with request k-1's (compact JSON of each
  message byte-equal). Reported as the share of eligible steps.
- orphans: in one request, a tool call with no later result answering it, or a result with no earlier open call
  (scanned in order: a result answers the newest earlier call of its id still unanswered, so a replay that reuses
  ``call_<step>_<i>`` ids in every turn is paired correctly).
- citation skeleton intact: each recorded web result (``{id, title, url, content}``) of a web_search result that
  appears in a served request or a persisted message has an item with the same id whose title and url are
  byte-equal to the recorded ones (content may be trimmed to a marker or a snippet).
- recoverable: the full output read back for a trimmed result equals the recorded original: the same text, or for
  entities the same JSON value (compact JSON byte-equal).
- pipeline overhead of step k: recordedAt(StepServed k) − recordedAt(StepServed k−1) − modelMs(k).
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

TERMINAL = ("TurnCompleted", "TurnFailed")
CALL_ID_PREFIX = "call_"
WEB_SEARCH = "web_search"
WEB_SEARCH_TOOL = {
    "name": WEB_SEARCH,
    "description": "Search the web. Results are citable entities {id, title, url, content}; cite them by id.",
    "inputSchema": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
}


def canonical(value: Any) -> bytes:
    """Compact JSON, key order kept, no ASCII escaping: how the runner renders a request."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


# ---------------------------------------------------------------- statistics

def percentile(xs: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of a non-empty sample."""
    if not xs:
        raise ValueError("percentile of an empty sample")
    s = sorted(xs)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def summary_ms(xs: Sequence[float]) -> dict[str, Any]:
    if not xs:
        return {"n": 0}
    return {"median_ms": round(statistics.median(xs), 2), "p99_ms": round(percentile(xs, 99), 2),
            "mean_ms": round(statistics.fmean(xs), 2), "max_ms": round(max(xs), 2), "n": len(xs)}


def mean_max(xs: Sequence[int]) -> dict[str, Any]:
    if not xs:
        return {"n": 0}
    return {"mean": round(statistics.fmean(xs), 1), "max": max(xs), "n": len(xs)}


# ---------------------------------------------------------------- turn events

def events_of(events: Iterable[Mapping[str, Any]], kind: str) -> list[Mapping[str, Any]]:
    return [e for e in events if e["type"] == kind]


def terminal_types(events: Iterable[Mapping[str, Any]]) -> list[str]:
    return [e["type"] for e in events if e["type"] in TERMINAL]


def served_steps(events: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """StepServed data in event order."""
    return [e["data"] for e in events if e["type"] == "StepServed"]


def compaction_steps(events: Iterable[Mapping[str, Any]]) -> set[int]:
    """Steps at which in-loop compaction acted (a fold recorded or a decision other than plain serve)."""
    out: set[int] = set()
    for e in events:
        if e["type"] in ("CompactionDecided", "InLoopFoldRecorded") and isinstance(e["data"].get("step"), int):
            out.add(e["data"]["step"])
    return out


def _ts(value: str) -> datetime:
    return datetime.fromisoformat(value)


def step_overheads(events: Sequence[Mapping[str, Any]]) -> list[tuple[int, float]]:
    """(step, ms) for every step k whose StepServed follows step k-1's: the wall time between the two events
    minus step k's model time. Steps after a gap (a resumed turn) are skipped."""
    out: list[tuple[int, float]] = []
    prev: Mapping[str, Any] | None = None
    for e in events:
        if e["type"] != "StepServed":
            continue
        if prev is not None and e["data"]["step"] == prev["data"]["step"] + 1:
            dt = (_ts(e["recordedAt"]) - _ts(prev["recordedAt"])).total_seconds() * 1000
            out.append((e["data"]["step"], dt - float(e["data"].get("modelMs") or 0)))
        prev = e
    return out


# ---------------------------------------------------------------- requests

def prefix_extends(prev: Mapping[str, Any], cur: Mapping[str, Any]) -> bool:
    """Request ``cur`` starts with request ``prev``: system and tools byte-equal, each earlier message byte-equal."""
    if canonical(prev.get("system")) != canonical(cur.get("system")):
        return False
    if canonical(prev.get("tools")) != canonical(cur.get("tools")):
        return False
    pm, cm = prev.get("messages") or [], cur.get("messages") or []
    if len(cm) < len(pm):
        return False
    return all(canonical(a) == canonical(b) for a, b in zip(pm, cm, strict=False))


def orphans(messages: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """Tool calls never answered later and results answering no earlier open call, in message order."""
    open_calls: dict[str, int] = {}  # call id → unanswered calls with that id
    order: list[str] = []
    orphan_results: list[str] = []
    for m in messages:
        for p in m.get("parts") or []:
            if p.get("type") == "tool-call":
                cid = p.get("toolCallId")
                open_calls[cid] = open_calls.get(cid, 0) + 1
                order.append(cid)
            elif p.get("type") == "tool-result":
                cid = p.get("toolCallId")
                if open_calls.get(cid, 0) > 0:
                    open_calls[cid] -= 1
                else:
                    orphan_results.append(cid)
    orphan_calls: list[str] = []
    left = dict(open_calls)
    for cid in reversed(order):  # the unanswered ones are the newest of their id
        if left.get(cid, 0) > 0:
            orphan_calls.append(cid)
            left[cid] -= 1
    return {"calls": list(reversed(orphan_calls)), "results": orphan_results}


def orphan_count(messages: Sequence[Mapping[str, Any]]) -> int:
    o = orphans(messages)
    return len(o["calls"]) + len(o["results"])


def duplicate_call_ids(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """Tool-call ids that occur more than once in one request (a wire hazard for providers that key on them)."""
    seen: dict[str, int] = {}
    for m in messages:
        for p in m.get("parts") or []:
            if p.get("type") == "tool-call":
                seen[p.get("toolCallId")] = seen.get(p.get("toolCallId"), 0) + 1
    return sorted(k for k, n in seen.items() if n > 1)


# ---------------------------------------------------------------- raw (untrimmed) history

def recorded_output(script: Sequence[Mapping[str, Any]], tool_call_id: str) -> dict[str, Any] | None:
    """The recorded output of the replay's call ``call_[<turn>_]<step>_<i>`` (None: not a replay id or no
    output); the runner prefixes each turn's ids with a piece of the turn id."""
    if not tool_call_id.startswith(CALL_ID_PREFIX):
        return None
    try:
        k, i = (int(x) for x in tool_call_id.rsplit("_", 2)[-2:])
    except ValueError:
        return None
    if not 1 <= k <= len(script):
        return None
    calls = script[k - 1].get("toolCalls") or []
    return calls[i - 1].get("output") if 1 <= i <= len(calls) else None


def untrimmed_steps(events: Sequence[Mapping[str, Any]], script: Sequence[Mapping[str, Any]]
                    ) -> dict[int, list[dict[str, Any]]]:
    """Step → the messages it added to the history (its assistant message, then its tool message) with every
    tool output as recorded (full), not as the pipeline trimmed it."""
    steps: dict[int, dict[str, Any]] = {}
    results: dict[int, dict[str, dict[str, Any]]] = {}
    for e in events:
        d = e["data"]
        if e["type"] == "StepServed" and d.get("assistantMessage"):
            steps[d["step"]] = d["assistantMessage"]
        elif e["type"] == "ToolResultRecorded":
            out = recorded_output(script, d["toolCallId"]) or d["output"]
            results.setdefault(d["step"], {})[d["toolCallId"]] = {
                "type": "tool-result", "toolCallId": d["toolCallId"], "toolName": d["toolName"], "output": out}
    added: dict[int, list[dict[str, Any]]] = {}
    for k in sorted(steps):
        a = steps[k]
        rows = [a]
        calls = [p["toolCallId"] for p in a.get("parts") or [] if p.get("type") == "tool-call"]
        if calls:
            got = results.get(k, {})
            rows.append({"role": "tool", "parts": [got[c] for c in calls if c in got]})
        added[k] = rows
    return added


UNPARSABLE = object()


def json_value(value: Any) -> Any:
    """A JSON value that may arrive as its JSON text (a served ``json`` output, a stored skeleton): parsed when it
    is a string (``UNPARSABLE`` when that string is not JSON), any other value as it is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return UNPARSABLE


# ---------------------------------------------------------------- citations (entities, SPEC §4)

def entity_items(output: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The items of an entities output as served (``json``) or stored (``persisted`` v2 envelope's skeleton);
    None when the output holds no entity list (e.g. a text marker)."""
    kind, value = output.get("type"), output.get("value")
    if kind == "persisted" and isinstance(value, Mapping) and value.get("shape") == "entities":
        value = value.get("skeleton")
    elif kind != "json":
        return None
    value = json_value(value)  # UNPARSABLE is not a list either
    if not isinstance(value, list) or not all(isinstance(i, Mapping) for i in value):
        return None
    return list(value)


@dataclass
class CitationCheck:
    """Web results seen in one or more requests / message lists."""

    parts: int = 0           # web_search tool-result parts looked at
    parts_broken: int = 0    # parts whose output is no entity list, or holds no recorded call's ids
    items: int = 0           # recorded items expected in those parts
    intact: int = 0          # … found with id, title and url byte-equal
    broken: list[str] = field(default_factory=list)  # a few examples

    def add(self, other: CitationCheck) -> None:
        self.parts += other.parts
        self.parts_broken += other.parts_broken
        self.items += other.items
        self.intact += other.intact
        self.broken.extend(other.broken[: max(0, 10 - len(self.broken))])

    def as_dict(self) -> dict[str, Any]:
        return {"parts": self.parts, "partsBroken": self.parts_broken, "items": self.items, "intact": self.intact,
                "intactShare": round(self.intact / self.items, 4) if self.items else None,
                "examples": self.broken[:10]}


def _note(c: CitationCheck, text: str) -> None:
    if len(c.broken) < 10:
        c.broken.append(text)


def check_citations(messages: Iterable[Mapping[str, Any]], recorded: Mapping[str, Mapping[str, Any]]
                    ) -> CitationCheck:
    """Every web_search result in ``messages`` against the recorded items (id → {id, title, url, …}): the call's
    items are the recorded ones sharing the id prefix (``<prefix>-<n>``) of the part's items."""
    by_prefix: dict[str, list[Mapping[str, Any]]] = {}
    for item_id, item in recorded.items():
        by_prefix.setdefault(item_id.rsplit("-", 1)[0], []).append(item)
    c = CitationCheck()
    for m in messages:
        for p in m.get("parts") or []:
            if p.get("type") != "tool-result" or (p.get("effectiveToolName") or p.get("toolName")) != WEB_SEARCH:
                continue
            c.parts += 1
            items = entity_items(p.get("output") or {})
            if items is None:
                c.parts_broken += 1
                _note(c, f"{p.get('toolCallId')}: output is not an entity list ({(p.get('output') or {}).get('type')})")
                continue
            prefixes = {str(i.get("id", "")).rsplit("-", 1)[0] for i in items}
            expected = [r for pre in prefixes for r in by_prefix.get(pre, [])]
            if not expected:
                c.parts_broken += 1
                _note(c, f"{p.get('toolCallId')}: no recorded call has ids {sorted(prefixes)}")
                continue
            served = {}
            for i in items:
                served.setdefault(i.get("id"), []).append(i)
            for r in expected:
                c.items += 1
                got = served.get(r["id"], [])
                if len(got) == 1 and got[0].get("title") == r["title"] and got[0].get("url") == r["url"]:
                    c.intact += 1
                else:
                    _note(c, f"{r['id']}: {len(got)} item(s) with that id; title/url "
                             f"{'differ' if got else 'missing'}")
    return c


# ---------------------------------------------------------------- recoverability

def same_output(original: Mapping[str, Any], readback: Mapping[str, Any]) -> bool:
    """The read-back output equals the recorded one: the text byte for byte, or the JSON value (compact JSON)."""
    a, b = original.get("value"), readback.get("value")
    if isinstance(a, str) and original.get("type") in ("text", "error-text"):
        return isinstance(b, str) and a.encode() == b.encode()
    a, b = json_value(a), json_value(b)
    return a is not UNPARSABLE and b is not UNPARSABLE and canonical(a) == canonical(b)


# ---------------------------------------------------------------- persisted history (kill test)

def history_problems(messages: Sequence[Mapping[str, Any]], turn_id: str, script: Sequence[Mapping[str, Any]]
                     ) -> list[str]:
    """What is wrong with a completed replay turn's persisted history: duplicate messages, the wrong number of
    assistant/tool messages for its script, or orphaned tool calls/results."""
    problems: list[str] = []
    ids = [m.get("id") for m in messages]
    if len(ids) != len(set(ids)):
        problems.append("a message occurs more than once")
    mine = [m for m in messages if m.get("turnId") == turn_id]
    assistants = sum(1 for m in mine if m.get("role") == "assistant")
    tools = sum(1 for m in mine if m.get("role") == "tool")
    tool_steps = sum(1 for s in script if s.get("toolCalls"))
    if assistants != len(script):
        problems.append(f"{assistants} assistant messages for {len(script)} model calls")
    if tools != tool_steps:
        problems.append(f"{tools} tool messages for {tool_steps} tool steps")
    o = orphans(messages)
    if o["calls"] or o["results"]:
        problems.append(f"orphans: {o}")
    return problems


# ---------------------------------------------------------------- the STORM web-research run → replay turns

def storm_entity_id_prefix(perspective: int, turn: int, query: str) -> str:
    """8 chars, deterministic (a rerun serves the same bytes), distinct per query."""
    return hashlib.sha256(f"{perspective}/{turn}/{query}".encode()).hexdigest()[:8]


def storm_turns(log: Sequence[Mapping[str, Any]]) -> tuple[list[tuple[str, list[dict[str, Any]]]],
                                                             dict[str, dict[str, Any]]]:
    """STORM's conversation_log.json (perspectives × dialogue turns × queries × results) → replay turns in log
    order and the recorded items by id. Each dialogue turn: the user's question, one ``web_search`` call per
    query whose recorded output is the entities shape (``{"type": "json", "value": [{id, title, url,
    content}…]}``, content = the result's snippets, or its description when it has none), then the agent's
    answer as the final text."""
    turns: list[tuple[str, list[dict[str, Any]]]] = []
    recorded: dict[str, dict[str, Any]] = {}
    for pi, perspective in enumerate(log):
        for ti, dlg in enumerate(perspective.get("dlg_turns") or []):
            steps: list[dict[str, Any]] = []
            for query in dlg.get("search_queries") or []:
                hits = [r for r in dlg.get("search_results") or [] if (r.get("meta") or {}).get("query") == query]
                if not hits:
                    continue
                prefix = storm_entity_id_prefix(pi, ti, query)
                items = []
                for n, r in enumerate(hits, start=1):
                    content = "\n\n".join(r.get("snippets") or []) or r.get("description") or ""
                    item = {"id": f"{prefix}-{n}", "title": r.get("title") or "", "url": r.get("url") or "",
                            "content": content}
                    items.append(item)
                    recorded[item["id"]] = item
                steps.append({"toolCalls": [{"toolName": WEB_SEARCH, "input": {"query": query},
                                             "output": {"type": "json", "value": items}}]})
            if not steps:
                continue
            steps.append({"text": dlg.get("agent_utterance") or "[no answer recorded]"})
            turns.append((dlg.get("user_utterance") or "(no question recorded)", steps))
    return turns, recorded
