"""The tool cache: one entry per server, plus an index tool id → (server id, tool name).

In memory, per replica, for now; the interface is async so a NATS KV bucket shared by all replicas (SPEC §11)
can replace it without touching the catalog.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..domain.resolution import CacheEntry, Status, changed


class InMemoryToolCache:
    def __init__(self) -> None:
        self._entries: dict[str, CacheEntry] = {}
        self._by_id: dict[str, tuple[str, dict[str, Any]]] = {}

    async def get(self, server_id: str) -> CacheEntry | None:
        return self._entries.get(server_id)

    async def get_many(self, server_ids: list[str]) -> dict[str, CacheEntry | None]:
        return {sid: self._entries.get(sid) for sid in server_ids}

    async def put(self, server_id: str, entry: CacheEntry) -> bool:
        """Store ``entry``; True when the server's tool list really changed (only then is a change signalled)."""
        previous = self._entries.get(server_id)
        self._entries[server_id] = entry
        for tid in [t for t, (sid, _) in self._by_id.items() if sid == server_id]:
            del self._by_id[tid]
        for tool in entry.tools:
            self._by_id[tool["id"]] = (server_id, dict(tool))
        return changed(previous, entry)

    async def find(self, tool_id: str) -> tuple[str, dict[str, Any]] | None:
        """(server id, tool) for a tool id of a server whose list is currently served."""
        hit = self._by_id.get(tool_id)
        if hit is None:
            return None
        entry = self._entries.get(hit[0])
        return hit if entry is not None and entry.status == Status.READY else None

    async def mark_stale(self, server_id: str) -> None:
        entry = self._entries.get(server_id)
        if entry is not None and not entry.stale:
            self._entries[server_id] = replace(entry, stale=True)
