"""Tool deferral (SPEC §11): which tools are replaced by the meta-tools for one request. Pure.

- threshold = floor(0.10 × W); W unknown (absent, not finite, ≤ 0) → 32,000.
- ``always`` tools are always deferred; ``never`` tools never are.
- the ``auto`` pool is deferred as a whole only if it has ≥ 5 tools AND its cost > threshold AND its cost > 500.
- cost of a tool = tokens (the shared tokenizer) of the compact JSON ``{name, description, schema}`` with the name
  and schema the model would see (tool id, wire schema of the request's dialect).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ctxbuild_codec.tokens import count_text

from .schemas import finite_window

UNKNOWN_WINDOW_THRESHOLD = 32_000
MIN_POOL_TOOLS = 5
MIN_POOL_COST = 500
THRESHOLD_FRACTION = 0.10


def threshold(window: Any) -> int:
    w = finite_window(window)
    return UNKNOWN_WINDOW_THRESHOLD if w is None else math.floor(THRESHOLD_FRACTION * w)


def tool_cost(name: str, description: str, schema: Any) -> int:
    text = json.dumps({"name": name, "description": description, "schema": schema},
                      ensure_ascii=False, separators=(",", ":"))
    return count_text(text)


@dataclass(frozen=True)
class Candidate:
    id: str
    defer: str  # auto | always | never
    cost: int


@dataclass
class Decision:
    threshold: int
    window: float | None
    auto_count: int = 0
    auto_cost: int = 0
    auto_deferred: bool = False
    reason: str = "no-tools"
    deferred: list[str] = field(default_factory=list)  # tool ids, in the order given
    deferred_cost: int = 0

    def to_payload(self) -> dict[str, Any]:
        return {"deferred": bool(self.deferred), "reason": self.reason, "threshold": self.threshold,
                "contextWindow": self.window, "autoPoolTools": self.auto_count, "autoPoolCost": self.auto_cost,
                "deferredCost": self.deferred_cost, "toolIds": list(self.deferred)}


def decide(tools: Sequence[Candidate], window: Any) -> Decision:
    d = Decision(threshold=threshold(window), window=finite_window(window))
    auto = [t for t in tools if t.defer == "auto"]
    always = [t for t in tools if t.defer == "always"]
    d.auto_count = len(auto)
    d.auto_cost = sum(t.cost for t in auto)
    if not auto:
        d.reason = "no-auto-tools"
    elif d.auto_count < MIN_POOL_TOOLS:
        d.reason = "auto-pool-under-5-tools"
    elif d.auto_cost <= MIN_POOL_COST:
        d.reason = "auto-pool-cost-at-most-500"
    elif d.auto_cost <= d.threshold:
        d.reason = "auto-pool-cost-within-threshold"
    else:
        d.auto_deferred = True
        d.reason = "auto-pool-deferred"
    chosen = {t.id for t in always} | ({t.id for t in auto} if d.auto_deferred else set())
    d.deferred = [t.id for t in tools if t.id in chosen]
    d.deferred_cost = sum(t.cost for t in tools if t.id in chosen)
    if always and not d.auto_deferred:
        d.reason += "; always-tools-deferred"
    return d


def namespaces(deferred: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``[{namespace, serverId, count}]`` in first-seen order."""
    out: dict[str, dict[str, Any]] = {}
    for t in deferred:
        key = t["serverId"]
        if key not in out:
            out[key] = {"namespace": t["namespace"], "serverId": key, "count": 0}
        out[key]["count"] += 1
    return list(out.values())


def system_prompt_block(spaces: Sequence[Mapping[str, Any]]) -> str:
    """The ``<deferred-tools>`` block for the system prompt: namespaces with counts."""
    total = sum(s["count"] for s in spaces)
    intro = (f"{total} more tools are available but not loaded. Find them with tool_search, read a tool's "
             "parameters with tool_inspect, then run it with tool_invoke (name = the tool's name from the "
             "search results).")
    lines = ["<deferred-tools>", intro,
             *[f"- {s['namespace']}: {s['count']} tool{'s' if s['count'] != 1 else ''}" for s in spaces],
             "</deferred-tools>"]
    return "\n".join(lines)
