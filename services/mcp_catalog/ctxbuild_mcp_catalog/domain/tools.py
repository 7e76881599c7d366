"""The catalog's form of an MCP tool (what the tool cache holds and resolve serves), and the pure figures the app
keeps per tool: its token cost on the wire, its fingerprint for the search index."""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from typing import Any

from . import deferral
from .tool_ids import tool_id


def cached_tool(server_id: str, label: str, name: str, description: str | None, input_schema: Any,
                annotations: dict[str, Any] | None = None) -> dict[str, Any]:
    """One tool of server ``server_id`` (namespace ``label``) as the cache keeps it."""
    out: dict[str, Any] = {
        "id": tool_id(server_id, name, label),
        "name": name,
        "serverId": server_id,
        "description": description or "",
        "inputSchema": input_schema,
    }
    if annotations:
        out["annotations"] = annotations
    return out


def compact(value: Any) -> str:
    """Compact JSON (the form a schema is hashed, costed and quoted in)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@lru_cache(maxsize=8192)
def _cost(name: str, description: str, frozen_schema: str) -> int:
    return deferral.tool_cost(name, description, json.loads(frozen_schema))


def wire_cost(name: str, description: str, wire_schema: Any) -> int:
    """``deferral.tool_cost`` of a wire tool, memoized on its compact schema (resolve costs every tool per turn)."""
    return _cost(name, description, compact(wire_schema))


def fingerprint(tool: dict[str, Any]) -> str:
    """What the search index of a tool depends on (description, schema, namespace), hashed."""
    return hashlib.sha256(compact([tool.get("description"), tool.get("inputSchema"), tool.get("namespace")])
                          .encode()).hexdigest()[:16]
