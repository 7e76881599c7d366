"""Wire-schema figures over the 14 real MCP catalogs (`make check-schemas` → bench/results/schemas.json).

For each catalog × dialect (anthropic, openai, openai-strict, gemini) every tool's input schema goes through the
catalog's sanitizer (ctxbuild_mcp_catalog.domain.schemas.wire_tool), plus the three meta-tools built over the
catalog (their examples taken from its first tool: the finding #1 case). Then, independently:
- ``invalid_wire_schemas``: a wire schema that fails the JSON Schema validator's metaschema check (draft 2020-12
  — what the wire schemas are, after draft-07 ones were rewritten) or the dialect's constraints (root object, no
  root combinator, resolvable $ref; OpenAI: arrays with items; strict: closed objects, all required, supported
  keywords only; Gemini: a JSON-Schema-expressed metaschema of the OpenAPI subset + non-empty OBJECT
  properties). Must be 0.
- ``invalid_examples_sent``: an example (tool-level inputExamples, schema-level examples/example, default) left on
  the wire that does not validate against the final wire schema. Must be 0.
- ``open_objects_before`` / ``open_objects_after``: explicit ``additionalProperties: true`` or ``{}`` in the
  originals and on each dialect's wire (Notion's 193 must all survive on the Anthropic wire).
- deferral over the union of the catalogs for a 200k and a 32k window: tools deferred, their tokens, and the
  tokens saved net of the meta-tools and the <deferred-tools> block.

Reads ../shared/data/mcp-catalogs relative to the repository root's parent; when absent, writes
``{"skipped": reason}`` and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ctxbuild_codec.tokens import count_text
from ctxbuild_mcp_catalog.adapters.catalog_files import load_catalogs
from ctxbuild_mcp_catalog.domain import deferral, meta, schemas
from ctxbuild_mcp_catalog.domain.schemas import DIALECTS

ROOT = Path(__file__).resolve().parents[1]
CATALOGS = ROOT.parent / "shared" / "data" / "mcp-catalogs"
WINDOWS = (200_000, 32_000)


def tool_tokens(wire: dict) -> int:
    return deferral.tool_cost(wire["name"], wire["description"], wire["inputSchema"])


def run(folder: Path) -> dict:
    t0 = time.perf_counter()
    catalogs = load_catalogs(folder)
    per_dialect = {d: {"invalid_wire_schemas": 0, "invalid_examples_sent": 0, "examples_sent": 0,
                       "examples_dropped": 0, "defaults_dropped": 0, "wire_tokens": 0} for d in DIALECTS}
    per_dialect["openai-strict"]["tools_strict"] = 0
    per_dialect["openai-strict"]["tools_not_strict"] = 0
    per_dialect["gemini"]["json_string_fields"] = 0
    per_dialect["gemini"]["tools_without_parameters"] = 0
    per_catalog: dict[str, dict] = {}
    failures: list[str] = []
    for server, tools in catalogs.items():
        row = {"tools": len(tools),
               "original_schemas_valid_for_claimed_draft": sum(schemas.claimed_draft_valid(t["inputSchema"])
                                                               for t in tools),
               "open_objects_before": sum(schemas.count_open_objects(t["inputSchema"]) for t in tools),
               "open_objects_after": {}, "wire_tokens": {}}
        for dialect in DIALECTS:
            agg = per_dialect[dialect]
            opened = tokens = 0
            items = [(t["id"], t["description"], t["inputSchema"], None) for t in tools] + \
                    [(m["name"], m["description"], m["inputSchema"], m["inputExamples"])
                     for m in meta.definitions(tools)]
            for i, (name, desc, schema, examples) in enumerate(items):
                wire, report = schemas.wire_tool(name, desc, schema, dialect, examples)
                problems = schemas.check_wire(wire["inputSchema"], dialect, wire.get("strict"))
                if problems:
                    agg["invalid_wire_schemas"] += 1
                    failures.append(f"{server}/{name}/{dialect}: {problems[:2]}")
                bad = schemas.check_examples(wire, dialect)
                agg["invalid_examples_sent"] += bad
                agg["examples_sent"] += report.examples_kept
                agg["examples_dropped"] += report.examples_dropped
                agg["defaults_dropped"] += report.defaults_dropped
                if i < len(tools):  # the catalog's own tools (not the meta-tools)
                    opened += schemas.count_open_objects(wire["inputSchema"] or {})
                    tokens += tool_tokens(wire)
                    if dialect == "openai-strict":
                        agg["tools_strict" if wire["strict"] else "tools_not_strict"] += 1
                    if dialect == "gemini":
                        agg["json_string_fields"] += schemas.count_json_strings(wire["inputSchema"] or {})
                        agg["tools_without_parameters"] += wire["inputSchema"] is None
            row["open_objects_after"][dialect] = opened
            row["wire_tokens"][dialect] = tokens
            agg["wire_tokens"] += tokens
        per_catalog[server] = row

    union = [t for tools in catalogs.values() for t in tools]
    defer: dict[str, dict] = {}
    for dialect in DIALECTS:
        wires = [schemas.wire_tool(t["id"], t["description"], t["inputSchema"], dialect)[0] for t in union]
        cands = [deferral.Candidate(t["id"], "auto", tool_tokens(w)) for t, w in zip(union, wires, strict=True)]
        metas = [schemas.wire_tool(m["name"], m["description"], m["inputSchema"], dialect, m["inputExamples"])[0]
                 for m in meta.definitions(union)]
        meta_cost = sum(tool_tokens(w) + (count_text(json.dumps(w.get("inputExamples"), separators=(",", ":")))
                                          if w.get("inputExamples") else 0) for w in metas)
        block = deferral.system_prompt_block(deferral.namespaces(union))
        out = {}
        for window in WINDOWS:
            d = deferral.decide(cands, window)
            saved = d.deferred_cost - (meta_cost + count_text(block) if d.deferred else 0)
            out[str(window)] = {"threshold": d.threshold, "auto_pool_tools": d.auto_count,
                                "auto_pool_tokens": d.auto_cost, "deferred": bool(d.deferred),
                                "tools_deferred": len(d.deferred), "tokens_deferred": d.deferred_cost,
                                "meta_tools_and_block_tokens": (meta_cost + count_text(block)) if d.deferred else 0,
                                "tokens_saved": saved, "reason": d.reason}
        defer[dialect] = out

    notion = per_catalog.get("notion-mcp-server", {})
    return {
        "catalogs": len(catalogs), "tools": len(union), "dialects": list(DIALECTS),
        "invalid_wire_schemas": sum(d["invalid_wire_schemas"] for d in per_dialect.values()),
        "invalid_examples_sent": sum(d["invalid_examples_sent"] for d in per_dialect.values()),
        "notion_open_objects": {"before": notion.get("open_objects_before"),
                                "after_anthropic": notion.get("open_objects_after", {}).get("anthropic")},
        "per_dialect": per_dialect,
        "per_catalog": per_catalog,
        "deferral_union": defer,
        "failures": failures[:50],
        "validator": "jsonschema Draft202012Validator.check_schema (+ Draft7Validator for the originals' claimed "
                     "draft) and the dialect rules in ctxbuild_mcp_catalog.domain.schemas.check_wire",
        "seconds": round(time.perf_counter() - t0, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--catalogs", type=Path, default=CATALOGS)
    args = ap.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if not args.catalogs.is_dir() or not any(args.catalogs.glob("*.tools.json")):
        reason = f"MCP catalogs not found at {args.catalogs} (../shared/data is not part of a plain clone)"
        args.out.write_text(json.dumps({"skipped": reason}, indent=2) + "\n")
        print(f"check-schemas skipped: {reason}")
        return 0
    result = run(args.catalogs)
    args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print(f"{result['catalogs']} catalogs, {result['tools']} tools × {len(DIALECTS)} dialects: "
          f"invalid_wire_schemas={result['invalid_wire_schemas']} "
          f"invalid_examples_sent={result['invalid_examples_sent']} "
          f"notion open objects {result['notion_open_objects']['before']} → "
          f"{result['notion_open_objects']['after_anthropic']} (anthropic)")
    for dialect, rows in result["deferral_union"].items():
        print(f"  {dialect}: " + "; ".join(f"W={w}: {r['tools_deferred']} deferred, {r['tokens_saved']} tokens saved"
                                           for w, r in rows.items()))
    ok = result["invalid_wire_schemas"] == 0 and result["invalid_examples_sent"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
