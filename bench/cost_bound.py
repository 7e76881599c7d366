"""Where ctxbuild's cache_adjusted_cost goes on the runs that exceed the window, and how low SPEC's trigger/keep
arithmetic lets it go (services/compaction/README.md, "Cost against the peers").

Reads a ``bench/context.py`` result (per run/window/strategy ``served_tokens_per_step`` and
``uncached_tokens_per_step``, the real served requests) and, per cell:

1. splits ctxbuild's measured cost into new tokens (1.25 × what a step adds), cache reads (0.1 × the cached
   prefix) and fold re-serves (1.25 × what a fold step re-sends beyond its new tokens);
2. replays the step sizes through a model of the policy: the context grows by each step's new tokens n_k (the
   measured uncached tokens of a non-fold step: the in-flight lane's trims included; at a fold step the raw
   history's growth, capped by that step's uncached tokens); once it would pass the trigger T the step is a fold:
   base (system + first request, cached) + summary S + the newest whole steps that fit the keep budget K, sent at
   1.25. ``spec`` = T 0.8·W, K 0.3·W with the measured summary size (it checks the model against the
   measurement); ``spec-ideal`` = the same with a 100-token summary row (a link and nothing else), the floor
   of any summarizer under SPEC's trigger/keep; ``floor`` = 1.25 × Σ n_k + 0.1 × base per step: every new token
   sent once, nothing re-read but the pinned base (no strategy that shows each output once pays less);
3. sweeps an earlier trigger T = f·W (keep K = min(0.3·W, 0.375·T), SPEC's keep/trigger ratio; the measured
   summary size, and a 100-token one) and reports the cheapest and the largest f reaching ratio ≤ 0.5, with the
   mean served context (what the model sees).

    .venv/bin/python bench/cost_bound.py bench/results/context.json [--strategy ctxbuild/extractive]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

CACHED, FRESH = 0.1, 1.25


def cost(served: list[int], uncached: list[int]) -> float:
    return sum(CACHED * (s - u) + FRESH * u for s, u in zip(served, uncached, strict=True))


def fold_steps(served: list[int], uncached: list[int]) -> list[int]:
    """Steps (0-based) whose request does not start with most of the previous one: a fold re-sent it."""
    return [k for k in range(1, len(served)) if served[k] - uncached[k] < 0.9 * served[k - 1]]


def new_tokens(served: list[int], uncached: list[int], growth: list[list[int]], folds: list[int]) -> list[int]:
    """What each step adds: a non-fold step's uncached tokens; at a fold step the smallest growth of the
    strategies that never compact (raw; deepagents_evict_2500, which evicts large outputs like the in-flight
    lane trims them), capped by the step's own uncached tokens."""
    out = list(uncached)
    for k in folds:
        out[k] = min([uncached[k], *(max(0, g[k] - g[k - 1]) for g in growth)])
    return out


def simulate(n: list[int], base: int, trigger: int, keep: int, summary: int) -> tuple[float, int, list[int]]:
    """Cost, number of folds and the served size per step of the model policy."""
    total, folds, served = FRESH * n[0], 0, [n[0]]
    ctx = n[0]
    for k in range(1, len(n)):
        if ctx + n[k] > trigger:
            kept, j = 0, k
            while j >= 1 and kept + n[j] <= keep:
                kept += n[j]
                j -= 1
            kept = kept or n[k]                    # at least the newest step
            ctx = base + summary + kept
            total += CACHED * base + FRESH * (summary + kept)
            folds += 1
        else:
            total += CACHED * ctx + FRESH * n[k]
            ctx += n[k]
        served.append(ctx)
    return total, folds, served


def summary_tokens(dump: Path | None) -> int | None:
    """The summary row's tokens in a cell's last request (``bench/context.py --dump``), if there is one."""
    if dump is None or not dump.exists():
        return None
    from ctxbuild_codec.tokens import count_text

    rows = json.loads(dump.read_text(encoding="utf-8")).get("last_request") or []
    sizes = [count_text(m["content"]) for m in rows if isinstance(m.get("content"), str)
             and m["content"].startswith("This session is being continued")]
    return max(sizes) if sizes else None


def analyse(cell: dict[str, Any], window: int, strategy: str, summary: int | None) -> dict[str, Any] | None:
    st = cell["strategies"]
    me, raw = st.get(strategy), st.get("raw")
    if me is None or raw is None or "uncached_tokens_per_step" not in me:
        return None
    peers = {k: v["cache_adjusted_cost"] for k, v in st.items() if not k.startswith("ctxbuild/")
             and v.get("no_task_steps") == 0 and (v.get("model_recoverable") or 0) >= 0.99}
    if not peers or max(raw["served_tokens_per_step"]) <= window:
        return None
    best_name = min(peers, key=peers.__getitem__)
    best = peers[best_name]
    s, u, r = me["served_tokens_per_step"], me["uncached_tokens_per_step"], raw["served_tokens_per_step"]
    folds = fold_steps(s, u)
    growth = [r, *([st["deepagents_evict_2500"]["served_tokens_per_step"]] if "deepagents_evict_2500" in st else [])]
    n = new_tokens(s, u, growth, folds)
    base = s[0]
    reserve = sum(u[k] - n[k] for k in folds)
    trigger, keep = int(0.8 * window), int(0.3 * window)
    summary = summary if summary is not None else 1_000
    spec = simulate(n, base, trigger, keep, summary)
    ideal = simulate(n, base, trigger, keep, 100)
    floor = FRESH * sum(n) + CACHED * base * (len(n) - 1)
    first_over = next((k for k in range(len(n)) if sum(n[:k + 1]) > trigger), len(n))
    pre_fold = cost(s[:first_over], u[:first_over])
    sweep = []
    for f in [x / 100 for x in range(10, 81, 5)]:
        t = int(f * window)
        k = min(keep, int(0.375 * t))
        c, nf, sv = simulate(n, base, t, k, summary)
        c100 = simulate(n, base, t, k, 100)[0]
        sweep.append({"triggerShare": f, "trigger": t, "keep": k, "cost": round(c), "ratio": round(c / best, 3),
                      "ratioWith100TokenSummary": round(c100 / best, 3), "folds": nf,
                      "meanServed": round(statistics.mean(sv)), "maxServed": max(sv)})
    reaching = next((x for x in reversed(sweep) if x["ratio"] <= 0.5), None)
    return {
        "bestPeer": best_name, "bestPeerCost": best, "target": round(0.5 * best),
        "measured": {"cost": me["cache_adjusted_cost"], "ratio": round(me["cache_adjusted_cost"] / best, 3),
                     "folds": len(folds), "foldSteps": [k + 1 for k in folds],
                     "newTokens": round(FRESH * sum(n[k] for k in range(len(n)))),
                     "cacheReads": round(CACHED * sum(s[k] - u[k] for k in range(len(s)))),
                     "foldReserve": round(FRESH * reserve),
                     "summarizerTokens": round(FRESH * me.get("llm_tokens", 0)),
                     "meanServed": round(statistics.mean(s))},
        "preFoldCost": round(pre_fold), "preFoldSteps": first_over,
        "model": {"spec": {"summaryTokens": summary, "cost": round(spec[0]), "ratio": round(spec[0] / best, 3),
                           "folds": spec[1]},
                  "specIdeal": {"summaryTokens": 100, "cost": round(ideal[0]), "ratio": round(ideal[0] / best, 3),
                                "folds": ideal[1], "meanServed": round(statistics.mean(ideal[2]))},
                  "floor": {"cost": round(floor), "ratio": round(floor / best, 3)}},
        "cheapestTrigger": min(sweep, key=lambda x: x["cost"]),
        "firstTriggerReaching0.5": reaching,
        "sweep": sweep,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", type=Path, nargs="?", default=Path("bench/results/context.json"))
    ap.add_argument("--strategy", default="ctxbuild/extractive")
    ap.add_argument("--sweep", action="store_true", help="print every trigger of the sweep")
    ap.add_argument("--dump", type=Path, help="bench/context.py --dump folder (the summary row's size per cell)")
    args = ap.parse_args()
    doc = json.loads(args.result.read_text(encoding="utf-8"))
    out = {}
    for run, r in doc["runs"].items():
        for w, cell in (r.get("windows") or {}).items():
            slug = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{run}-{w}-{args.strategy.split('/')[-1]}") + ".json"
            a = analyse(cell, int(w), args.strategy, summary_tokens(args.dump / slug if args.dump else None))
            if a is not None:
                if not args.sweep:
                    a.pop("sweep")
                out[f"{run} W={w}"] = a
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
