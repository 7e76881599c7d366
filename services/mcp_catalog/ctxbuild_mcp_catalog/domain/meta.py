"""The meta-tools that stand in for deferred tools (SPEC §11): ``tool_search``, ``tool_inspect``, ``tool_invoke``.
Pure: definitions, search output (ranking in ranking.py), signatures and the ``tool_invoke`` guards; the catalog
does the I/O.

The model addresses a deferred tool by its tool id (the name it would have if it were loaded).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator

from .ranking import SearchIndex, tokenize
from .schemas import coerce_arguments, deref, is_valid, normalize, types_of

TOOL_SEARCH, TOOL_INSPECT, TOOL_INVOKE = "tool_search", "tool_inspect", "tool_invoke"
META_TOOLS = (TOOL_SEARCH, TOOL_INSPECT, TOOL_INVOKE)
DEFAULT_LIMIT = 5
MAX_LIMIT = 20
DESCRIPTION_CHARS = 300

SEARCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "minLength": 1,
                  "description": "what the tool should do, or words from its name or parameters"},
        "limit": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT,
                  "description": f"how many results (default {DEFAULT_LIMIT})"},
    },
    "required": ["query"],
    "additionalProperties": False,
}
INSPECT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1, "description": "a tool name from tool_search"}},
    "required": ["name"],
    "additionalProperties": False,
}
INVOKE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "description": "a tool name from tool_search"},
        # the inner tool's arguments: an explicitly open object (finding #1: a sanitizer must keep it open, or
        # the example below stops being valid and Anthropic rejects the whole request)
        "params": {"type": "object", "additionalProperties": True,
                   "description": "the tool's arguments, matching the signature from tool_inspect"},
    },
    "required": ["name", "params"],
    "additionalProperties": False,
}
SCHEMAS = {TOOL_SEARCH: SEARCH_SCHEMA, TOOL_INSPECT: INSPECT_SCHEMA, TOOL_INVOKE: INVOKE_SCHEMA}
DESCRIPTIONS = {
    TOOL_SEARCH: "Search the deferred tools (listed in <deferred-tools>) by what they do; returns tool names, "
                 "ranked.",
    TOOL_INSPECT: "Show a deferred tool's signature: its description and the JSON Schema of its parameters.",
    TOOL_INVOKE: "Run a deferred tool by name with its parameters. Inspect the tool first (tool_inspect); the "
                 "parameters must match its signature.",
}


# ---------------------------------------------------------------- definitions
def definitions(deferred: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The three meta-tools ``{name, description, inputSchema, inputExamples}`` (neutral, before sanitizing).
    Examples use the first deferred tool, so they are concrete and deterministic for a given catalog."""
    first = deferred[0] if deferred else None
    name = first["id"] if first else "mcp__server__tool_0123456789abcdef0123"
    words = " ".join(tokenize(first["name"])) if first else "tool"
    params = example_params(first.get("inputSchema") if first else None)
    examples = {TOOL_SEARCH: [{"query": words or "tool"}], TOOL_INSPECT: [{"name": name}],
                TOOL_INVOKE: [{"name": name, "params": params}]}
    return [{"name": n, "description": DESCRIPTIONS[n], "inputSchema": SCHEMAS[n], "inputExamples": examples[n]}
            for n in META_TOOLS]


def example_params(schema: Any) -> dict[str, Any]:
    """Arguments for a tool_invoke example: the required properties with plausible values (its own examples,
    default, first enum value, else a placeholder by type); ``{}`` when that would not be valid."""
    if not isinstance(schema, dict):
        return {}
    root = normalize(schema)
    out: dict[str, Any] = {}
    props = root.get("properties") or {}
    for key in root.get("required") or []:
        sub = deref(root, props.get(key, {}))
        out[key] = _example_value(key, sub if isinstance(sub, dict) else {})
    return out if is_valid(root, out) else {}


def _example_value(key: str, sub: dict[str, Any]) -> Any:
    if isinstance(sub.get("examples"), list) and sub["examples"]:
        return sub["examples"][0]
    if "default" in sub:
        return sub["default"]
    if "const" in sub:
        return sub["const"]
    if isinstance(sub.get("enum"), list) and sub["enum"]:
        return sub["enum"][0]
    t = (types_of(sub) or ["string"])[0]
    return {"string": f"<{key}>", "integer": max(1, int(sub.get("minimum", 1) or 1)),
            "number": max(1, sub.get("minimum", 1) or 1), "boolean": True, "array": [], "object": {},
            "null": None}.get(t, f"<{key}>")


# ---------------------------------------------------------------- search
# the ranking (BM25 fused with sentence embeddings) lives in ranking.py
def search_output(index: SearchIndex, query: str, limit: int, namespaces: Sequence[str]) -> dict[str, Any]:
    hits = index.search(query, limit)
    if not hits:
        return text_output({"query": query, "results": [],
                            "hint": "no deferred tool matches; try other words. Namespaces: "
                                    + ", ".join(namespaces)})
    return text_output({"query": query, "results": [
        {"name": t["id"], "namespace": t.get("namespace", ""), "score": s,
         "description": _short(t.get("description", ""))} for t, s in hits]})


def _short(text: str) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= DESCRIPTION_CHARS else text[:DESCRIPTION_CHARS - 1] + "…"


# ---------------------------------------------------------------- inspect / invoke
def signature(tool: Mapping[str, Any]) -> dict[str, Any]:
    return {"name": tool["id"], "namespace": tool.get("namespace", ""), "description": tool.get("description", ""),
            "parameters": normalize(tool.get("inputSchema"))}


def text_output(value: Any) -> dict[str, Any]:
    return {"type": "text", "value": json.dumps(value, ensure_ascii=False, separators=(",", ":"))}


def error_output(message: str) -> dict[str, Any]:
    return {"type": "error-text", "value": message}


@dataclass(frozen=True)
class Lookup:
    """What the guards need to know of the tool a name points at, from the live catalog."""

    tool: Mapping[str, Any] | None  # None: not in the catalog (any more)
    not_executable: str | None = None  # why it cannot run now (server disabled / not ready / tool disabled)
    approval: str = "auto"


@dataclass(frozen=True)
class Guarded:
    """The guards' verdict: run ``tool`` with ``params`` or answer ``output``; ``inspected`` when the name is
    now inspected (the signature was shown)."""

    output: dict[str, Any] | None = None
    tool: Mapping[str, Any] | None = None
    params: dict[str, Any] | None = None
    inspected: str | None = None


def check_invoke(name: Any, params: Any, deferred: Sequence[str], inspected: Sequence[str],
                 lookup: Lookup | None) -> Guarded:
    """tool_invoke's guards in the spec's order: allowed name, exists, executable, not approval-gated, inspected
    (else the signature), params valid (else the signature)."""
    if not isinstance(name, str) or name in META_TOOLS or name not in set(deferred):
        return Guarded(output=error_output(
            f"tool_invoke: {name!r} is not one of this turn's deferred tools. Loaded tools are called directly; "
            "find deferred ones with tool_search."))
    if lookup is None or lookup.tool is None:
        return Guarded(output=error_output(f"tool_invoke: the tool {name!r} no longer exists in the catalog."))
    if lookup.not_executable:
        return Guarded(output=error_output(f"tool_invoke: the tool {name!r} cannot run now: "
                                           f"{lookup.not_executable}."))
    if lookup.approval == "required":
        return Guarded(output=error_output(
            f"tool_invoke: the tool {name!r} needs the user's approval and cannot be run through tool_invoke."))
    sig = signature(lookup.tool)
    if name not in set(inspected):
        return Guarded(inspected=name, output=error_output(
            "tool_invoke: inspect a tool before invoking it. Its signature follows; call tool_invoke again with "
            "params that match it.\n" + json.dumps(sig, ensure_ascii=False, separators=(",", ":"))))
    schema = lookup.tool.get("inputSchema")
    args = coerce_arguments(schema, params if params is not None else {})
    root = normalize(schema)
    errors = [] if isinstance(args, dict) else ["params must be an object"]
    if not errors:
        v = Draft202012Validator(root)
        errors = [f"/{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}"
                  for e in sorted(v.iter_errors(args), key=lambda e: list(map(str, e.absolute_path)))][:5]
    if errors:
        return Guarded(output=error_output(
            "tool_invoke: params do not match the tool's signature (" + "; ".join(errors) + ").\n"
            + json.dumps(sig, ensure_ascii=False, separators=(",", ":"))))
    return Guarded(tool=lookup.tool, params=args)


def inner_call_id(outer: str | None, name: str) -> str:
    """The inner tool's call id: ``<outer>::<name>``."""
    return f"{outer or 'call'}::{name}"
