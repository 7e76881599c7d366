"""tool_search ranking quality and speed (`make bench-tool-search` → bench/results/tool_search.json).

All 181 tools of the 14 real MCP catalogs (../shared/data/mcp-catalogs) form one deferred catalog; each request
of tests/data/tool_search_queries.json (the project's own evaluation set, written before any tuning) is searched
and the rank of its expected tool (server + name; ``alsoRight`` twins count too) is taken from:
- ``lexical``: BM25 alone (ranking.SearchIndex without vectors),
- ``semantic``: cosine of all-MiniLM-L6-v2 vectors alone,
- ``fusion``: the shipped ranking, relative score fusion of both (ranking.LEXICAL_WEIGHT).
Figures: recall@1/@3/@5 and MRR (a tool not returned counts 0), per ranker, per request style and per server;
``fusion_grid``: relative score fusion at other lexical weights and reciprocal rank fusion at a few k / weights,
to show how sensitive the shipped choice is;
``misses``: the requests whose tool the shipped ranker leaves out of its top 5. Latency: one ``search`` (query
embedding + BM25 + fusion) with the 181 tools registered, over every request, ``--rounds`` times; p50/p99 in ms.
``held_out``: the same figures over the file's ``heldOut`` requests (written after the first measurement, before
any later change). ``overlap``: how many requests share at most one word (after tokenizing) with their tool's
name + description.

Reads ../shared/data; when absent writes ``{"skipped": reason}`` and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from ctxbuild_mcp_catalog.adapters.embedder import load_embedder
from ctxbuild_mcp_catalog.domain import ranking
from ctxbuild_mcp_catalog.domain.tool_ids import tool_id
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

ROOT = Path(__file__).resolve().parents[1]
CATALOGS = ROOT.parent / "shared" / "data" / "mcp-catalogs"
QUERIES = ROOT / "tests" / "data" / "tool_search_queries.json"
TARGETS = {"recall_at_5": 0.95, "mrr": 0.85, "p99_ms": 20.0}


def load_tools(folder: Path) -> list[dict]:
    tools = []
    for f in sorted(folder.glob("*.tools.json")):
        doc = json.loads(f.read_text())
        tools += [{"id": tool_id(doc["server"], t["name"], doc["server"]), "name": t["name"],
                   "serverId": doc["server"], "namespace": doc["server"],
                   "description": t.get("description") or "", "inputSchema": t["inputSchema"]}
                  for t in doc["tools"]]
    return tools


def rank_of(index: ranking.SearchIndex, order: list[int], q: dict) -> int | None:
    right = {q["tool"], *q.get("alsoRight", [])}
    for r, i in enumerate(order, start=1):
        t = index.tools[i]
        if t["serverId"] == q["server"] and t["name"] in right:
            return r
    return None


def _rsf(index: ranking.SearchIndex, query: str, alpha: float) -> list[int]:
    """The shipped index's order with another lexical weight (same inputs, same floor)."""
    alpha_was = index.alpha
    index.alpha = alpha
    try:
        return [i for i, _ in index.ranked(query)]
    finally:
        index.alpha = alpha_was


def figures(ranks: list[int | None]) -> dict:
    n = len(ranks)
    return {"n": n, **{f"recall_at_{k}": round(sum(1 for r in ranks if r and r <= k) / n, 4) for k in (1, 3, 5)},
            "mrr": round(sum(1 / r for r in ranks if r) / n, 4)}


def run(rounds: int) -> dict:
    tools = load_tools(CATALOGS)
    doc = json.loads(QUERIES.read_text())
    queries, held_out = doc["queries"], doc.get("heldOut", [])
    t0 = time.perf_counter()
    embedder = load_embedder()
    if embedder is None:
        sys.exit("the embedding model did not load: no semantic figures")
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    vectors = ranking.pool_views(embedder.embed(ranking.semantic_texts(tools)))
    embed_s = time.perf_counter() - t0
    lexical = ranking.SearchIndex(tools)
    shipped = ranking.SearchIndex(tools, vectors, embedder.embed)

    orders: dict[str, list[list[int]]] = {"lexical": [], "semantic": [], "fusion": []}
    rrf_points = [(k, w) for k in (10, 60) for w in (0.25, 0.5, 1.0)]
    rsf_points = (0.0, 0.1, 0.2, 0.25, 0.3, 0.5)
    grid: dict[str, list[list[int]]] = {f"rrf k={k},lexical_weight={w}": [] for k, w in rrf_points}
    grid |= {f"rsf lexical_weight={a}": [] for a in rsf_points}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True) as progress:
        task = progress.add_task("rank", total=len(queries))
        for q in queries:
            lex = [i for i, _ in shipped.lexical(q["query"])]
            sem = [i for i, _ in shipped.semantic(q["query"])]
            orders["lexical"].append([i for i, _ in lexical.ranked(q["query"])])
            orders["semantic"].append(sem)
            orders["fusion"].append([i for i, _ in shipped.ranked(q["query"])])
            for k, w in rrf_points:
                grid[f"rrf k={k},lexical_weight={w}"].append([i for i, _ in ranking.rrf([(lex, w), (sem, 1.0)], k)])
            for a in rsf_points:
                grid[f"rsf lexical_weight={a}"].append(_rsf(shipped, q["query"], a))
            progress.advance(task)
        ranks = {name: [rank_of(shipped, o, q) for o, q in zip(os_, queries, strict=True)]
                 for name, os_ in orders.items()}

        latencies: list[float] = []
        task = progress.add_task("latency", total=rounds * len(queries))
        for _ in range(rounds):
            for q in queries:
                t = time.perf_counter()
                shipped.search(q["query"], 5)
                latencies.append((time.perf_counter() - t) * 1000)
                progress.advance(task)

    def subset(pred) -> dict:
        keep = [i for i, q in enumerate(queries) if pred(q)]
        return {name: figures([r[i] for i in keep]) for name, r in ranks.items()}

    styles = sorted({q["style"] for q in queries})
    servers = sorted({q["server"] for q in queries})
    overlap = 0
    by_key = {(t["serverId"], t["name"]): t for t in tools}
    for q in queries:
        t = by_key[(q["server"], q["tool"])]
        described = set(ranking.tokenize(f"{t['name']} {t['description']}"))
        overlap += len(set(ranking.tokenize(q["query"])) & described) <= 1
    held = {"lexical": [rank_of(shipped, [i for i, _ in lexical.ranked(q["query"])], q) for q in held_out],
            "semantic": [rank_of(shipped, [i for i, _ in shipped.semantic(q["query"])], q) for q in held_out],
            "fusion": [rank_of(shipped, [i for i, _ in shipped.ranked(q["query"])], q) for q in held_out]}
    lat = np.array(latencies)
    fusion = figures(ranks["fusion"])
    out = {
        "tools": len(tools), "catalogs": len({t["serverId"] for t in tools}), "queries": len(queries),
        "requests_sharing_at_most_one_word_with_their_tool": overlap,
        "model": embedder.model_id, "model_load_s": round(load_s, 3),
        "embed_181_tools_s": round(embed_s, 3),
        "fusion_method": f"relative score fusion: (1 - {ranking.LEXICAL_WEIGHT})*minmax(cosine) + "
                         f"{ranking.LEXICAL_WEIGHT}*minmax(bm25); abbreviations expanded; semantic floor "
                         f"{ranking.SEMANTIC_FLOOR}",
        "rankers": {name: figures(r) for name, r in ranks.items()},
        "held_out": {name: figures(r) for name, r in held.items()} if held_out else None,
        "by_style": {s: subset(lambda q, s=s: q["style"] == s) for s in styles},
        "by_server_fusion": {s: subset(lambda q, s=s: q["server"] == s)["fusion"] for s in servers},
        "fusion_grid": {name: figures([rank_of(shipped, o, q) for o, q in zip(os_, queries, strict=True)])
                        for name, os_ in grid.items()},
        "search_latency_ms": {"n": len(lat), "p50": round(float(np.percentile(lat, 50)), 3),
                              "p99": round(float(np.percentile(lat, 99)), 3),
                              "max": round(float(lat.max()), 3)},
        "misses": [{"query": q["query"], "expected": f"{q['server']}/{q['tool']}", "rank": r,
                    "top3": [f"{shipped.tools[i]['serverId']}/{shipped.tools[i]['name']}" for i in o[:3]]}
                   for q, r, o in zip(queries, ranks["fusion"], orders["fusion"], strict=True) if not r or r > 5],
        "shipped": {"ranker": "fusion", "recall_at_1": fusion["recall_at_1"], "recall_at_5": fusion["recall_at_5"],
                    "mrr": fusion["mrr"], "p99_ms": round(float(np.percentile(lat, 99)), 3)},
        "targets": TARGETS,
    }
    out["targets_met"] = {"recall_at_5": out["shipped"]["recall_at_5"] >= TARGETS["recall_at_5"],
                          "mrr": out["shipped"]["mrr"] >= TARGETS["mrr"],
                          "p99_ms": out["shipped"]["p99_ms"] <= TARGETS["p99_ms"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tool_search.json")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not CATALOGS.is_dir():
        result: dict = {"skipped": f"shared data folder absent ({CATALOGS})"}
    else:
        result = run(args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    summary = {k: result[k] for k in ("rankers", "held_out", "search_latency_ms", "shipped", "targets_met")
               if k in result}
    print(json.dumps(summary or result, indent=2))


if __name__ == "__main__":
    main()
