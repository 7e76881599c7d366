"""MCP modes, server selection for a turn, tool-cache freshness and the resolve reply (SPEC §11, finding #6).

One default mode everywhere: ``manual`` (only the servers linked to the assistant). ``auto`` = every active
server, ``disabled`` = none. A cold or stale server is warmed before resolving (the caller awaits it, bounded);
a server that is still not ready is reported as ``warming`` or ``failed`` — never silently as "no tools".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

Mode = Literal["manual", "auto", "disabled"]
MODES: tuple[Mode, ...] = ("manual", "auto", "disabled")
DEFAULT_MODE: Mode = "manual"

EMPTY_RETRY_S = 300.0  # a server that listed no tools is asked again after 5 min
FAILURE_RETRY_S = 30.0  # a server that failed to start or list is retried after 30 s


class Status(StrEnum):
    COLD = "cold"  # never warmed in this cache
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class ServerRef:
    """What selection needs to know of a configured server."""

    id: str
    active: bool = True


def normalize_mode(mode: str | None) -> Mode:
    if mode is None:
        return DEFAULT_MODE
    if mode not in MODES:
        raise ValueError(f"unknown MCP mode {mode!r}")
    return mode  # type: ignore[return-value]


def select_servers(mode: Mode, linked: Sequence[str] | None, configured: Sequence[ServerRef]) -> list[str]:
    """Server ids to resolve for a turn, in a deterministic order.

    manual → the linked ids in the caller's order (deduplicated; unknown ids are kept so the reply can report
    them); auto → every active configured server in configuration order; disabled → none."""
    if mode == "disabled":
        return []
    if mode == "auto":
        return [s.id for s in configured if s.active]
    return list(dict.fromkeys(linked or ()))


@dataclass(frozen=True)
class CacheEntry:
    """One server's cached tool list. ``tools`` are wire-shaped dicts (id, name, serverId, description,
    inputSchema); ``fingerprint`` identifies the list's content so a refresh signals only a real change."""

    status: Status
    tools: tuple[Mapping[str, Any], ...] = ()
    error: str | None = None
    updated_at: float = 0.0
    fingerprint: str = ""
    stale: bool = False  # the server said its list changed


COLD = CacheEntry(Status.COLD)


def needs_warm(entry: CacheEntry | None, now: float) -> bool:
    """Should this server be (re)warmed now? (A warm already in flight is joined by the caller instead.)"""
    if entry is None or entry.status == Status.COLD:
        return True
    if entry.stale:
        return True
    if entry.status == Status.FAILED:
        return now - entry.updated_at >= FAILURE_RETRY_S
    if not entry.tools:
        return now - entry.updated_at >= EMPTY_RETRY_S
    return False


def fingerprint(tools: Iterable[Mapping[str, Any]]) -> str:
    canon = json.dumps(sorted((dict(t) for t in tools), key=lambda t: t["id"]), sort_keys=True,
                       separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode()).hexdigest()


def ready_entry(tools: Sequence[Mapping[str, Any]], now: float) -> CacheEntry:
    ordered = tuple(sorted(tools, key=lambda t: t["name"]))
    return CacheEntry(Status.READY, ordered, None, now, fingerprint(ordered))


def failed_entry(previous: CacheEntry | None, error: str, now: float) -> CacheEntry:
    """A failed refresh; the last good tool list is kept (reported with the failure) but not served."""
    prev_tools = previous.tools if previous else ()
    prev_fp = previous.fingerprint if previous else ""
    return CacheEntry(Status.FAILED, prev_tools, error, now, prev_fp)


def changed(previous: CacheEntry | None, current: CacheEntry) -> bool:
    return previous is None or previous.fingerprint != current.fingerprint


@dataclass
class Resolution:
    tools: list[dict[str, Any]] = field(default_factory=list)
    servers: list[dict[str, Any]] = field(default_factory=list)

    def to_payload(self) -> dict[str, Any]:
        return {"tools": self.tools, "servers": self.servers}


def resolve(selected: Sequence[str], entries: Mapping[str, CacheEntry | None], known: Iterable[str],
            in_flight: Iterable[str] = ()) -> Resolution:
    """Assemble the reply from the cache after the (bounded) warm-up.

    Tools of ready servers come in selection order (by name within a server); one status per selected server:
    ``ready`` (also while a refresh runs: the last good list is served), ``warming`` (no usable list yet and a
    warm-up still running), ``failed`` with its error (also for an id that is not configured)."""
    known_ids, warming = set(known), set(in_flight)
    out = Resolution()
    seen_tool_ids: set[str] = set()
    for sid in selected:
        if sid not in known_ids:
            out.servers.append({"id": sid, "status": "failed", "error": "MCP server is not configured"})
            continue
        entry = entries.get(sid)
        if entry is not None and entry.status == Status.READY:
            out.servers.append({"id": sid, "status": "ready"})
            for tool in entry.tools:
                if tool["id"] not in seen_tool_ids:
                    seen_tool_ids.add(tool["id"])
                    out.tools.append(dict(tool))
        elif sid in warming or entry is None or entry.status == Status.COLD:
            out.servers.append({"id": sid, "status": "warming"})
        else:
            out.servers.append({"id": sid, "status": "failed", "error": entry.error or "unknown error"})
    return out
