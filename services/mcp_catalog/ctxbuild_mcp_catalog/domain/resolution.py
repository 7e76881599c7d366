"""MCP modes, server selection for a turn, tool-cache freshness and the resolve view (SPEC §11, finding #6).

One default mode everywhere, defined here once: ``manual`` (only the servers linked to the assistant). ``auto`` =
every active enabled server, ``disabled`` = none. A cold or stale server is warmed before resolving (the caller
awaits it, bounded); a server that is still not ready is reported as ``warming``, ``error`` or ``disabled`` —
never silently as "no tools".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Literal

Mode = Literal["manual", "auto", "disabled"]
MODES: tuple[Mode, ...] = ("manual", "auto", "disabled")
DEFAULT_MODE: Mode = "manual"

EMPTY_RETRY_S = 300.0  # a server that listed no tools is asked again after 5 min
FAILURE_RETRY_S = 30.0  # a server that failed to start or list is retried after 30 s


class Status(StrEnum):
    COLD = "cold"  # never warmed (no cache entry)
    READY = "ready"
    ERROR = "error"


@dataclass(frozen=True)
class ServerRef:
    """What selection needs to know of a registered server."""

    id: str
    active: bool = True
    enabled: bool = True


def normalize_mode(mode: str | None) -> Mode:
    if mode is None:
        return DEFAULT_MODE
    if mode not in MODES:
        raise ValueError(f"unknown MCP mode {mode!r}")
    return mode  # type: ignore[return-value]


def select_servers(mode: Mode, linked: Sequence[str] | None, registered: Sequence[ServerRef]) -> list[str]:
    """Server ids to resolve for a turn, in a deterministic order.

    manual → the linked ids in the caller's order (deduplicated; unknown or disabled ids are kept so the reply
    can report them); auto → every active, enabled server in registry order; disabled → none."""
    if mode == "disabled":
        return []
    if mode == "auto":
        return [s.id for s in registered if s.active and s.enabled]
    return list(dict.fromkeys(linked or ()))


@dataclass(frozen=True)
class CacheEntry:
    """One server's cached tool list. ``tools`` are wire-shaped dicts (id, name, serverId, description,
    inputSchema[, annotations]); ``fingerprint`` identifies the list's content so a refresh signals only a real
    change; ``config`` is the connection hash of the server config the list was taken with."""

    status: Status
    tools: tuple[Mapping[str, Any], ...] = ()
    error: str | None = None
    updated_at: float = 0.0
    fingerprint: str = ""
    stale: bool = False  # the server said its list changed
    config: str = ""

    def to_json(self) -> bytes:
        return json.dumps({"status": self.status.value, "tools": list(self.tools), "error": self.error,
                           "updatedAt": self.updated_at, "fingerprint": self.fingerprint, "stale": self.stale,
                           "config": self.config}, ensure_ascii=False, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> CacheEntry:
        d = json.loads(raw)
        return cls(Status(d["status"]), tuple(d.get("tools") or ()), d.get("error"), float(d.get("updatedAt", 0)),
                   d.get("fingerprint", ""), bool(d.get("stale")), d.get("config", ""))

    def with_stale(self) -> CacheEntry:
        return replace(self, stale=True)


COLD = CacheEntry(Status.COLD)


def needs_warm(entry: CacheEntry | None, now: float, config: str | None = None) -> bool:
    """Should this server be (re)warmed now? (A warm already in flight is joined by the caller instead.)"""
    if entry is None or entry.status == Status.COLD:
        return True
    if config is not None and entry.config != config:
        return True
    if entry.stale:
        return True
    if entry.status == Status.ERROR:
        return now - entry.updated_at >= FAILURE_RETRY_S
    if not entry.tools:
        return now - entry.updated_at >= EMPTY_RETRY_S
    return False


def servable(entry: CacheEntry | None, config: str | None = None) -> bool:
    """Is the entry's tool list served? Ready and taken with the server's current config."""
    return entry is not None and entry.status == Status.READY and (config is None or entry.config == config)


def fingerprint(tools: Iterable[Mapping[str, Any]]) -> str:
    canon = json.dumps(sorted((dict(t) for t in tools), key=lambda t: t["id"]), sort_keys=True,
                       separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode()).hexdigest()


def ready_entry(tools: Sequence[Mapping[str, Any]], now: float, config: str = "") -> CacheEntry:
    ordered = tuple(sorted(tools, key=lambda t: t["name"]))
    return CacheEntry(Status.READY, ordered, None, now, fingerprint(ordered), False, config)


def failed_entry(previous: CacheEntry | None, error: str, now: float, config: str = "") -> CacheEntry:
    """A failed refresh; the last good tool list is kept (reported with the failure) but not served."""
    prev_tools = previous.tools if previous else ()
    prev_fp = previous.fingerprint if previous else ""
    return CacheEntry(Status.ERROR, prev_tools, error, now, prev_fp, False, config)


def changed(previous: CacheEntry | None, current: CacheEntry) -> bool:
    return previous is None or previous.fingerprint != current.fingerprint


@dataclass
class ServerView:
    """What resolve knows of one selected server."""

    id: str
    registered: bool
    enabled: bool = True
    config: str = ""
    label: str = ""


@dataclass
class Resolution:
    tools: list[dict[str, Any]] = field(default_factory=list)
    servers: list[dict[str, Any]] = field(default_factory=list)

    def to_payload(self) -> dict[str, Any]:
        return {"tools": self.tools, "servers": self.servers}


def resolve(selected: Sequence[ServerView], entries: Mapping[str, CacheEntry | None],
            warming: Iterable[str] = ()) -> Resolution:
    """Assemble the reply from the cache after the (bounded) warm-up.

    Tools of ready servers come in selection order (by name within a server); one status per selected server:
    ``ready`` (also while a refresh runs: the last good list is served), ``warming`` (no usable list yet and a
    warm-up still running or not yet started), ``error`` with its error (also for an id that is not registered),
    ``disabled`` (registered but disabled: never started)."""
    warming_ids = set(warming)
    out = Resolution()
    seen_tool_ids: set[str] = set()
    for s in selected:
        if not s.registered:
            out.servers.append({"id": s.id, "status": "error", "error": "MCP server is not registered"})
            continue
        if not s.enabled:
            out.servers.append({"id": s.id, "status": "disabled"})
            continue
        entry = entries.get(s.id)
        if servable(entry, s.config or None):
            assert entry is not None
            out.servers.append({"id": s.id, "status": "ready"})
            for tool in entry.tools:
                if tool["id"] not in seen_tool_ids:
                    seen_tool_ids.add(tool["id"])
                    out.tools.append(dict(tool))
        elif s.id in warming_ids or entry is None or entry.status == Status.COLD or \
                (s.config and entry.config != s.config) or entry.status == Status.READY:
            out.servers.append({"id": s.id, "status": "warming"})
        else:
            out.servers.append({"id": s.id, "status": "error", "error": entry.error or "unknown error"})
    return out
