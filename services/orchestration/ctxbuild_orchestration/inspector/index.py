"""The tenant's conversations for the inspector's list page.

The API has no listing (a front end keeps its own list); the inspector builds one per edge replica by tailing
persistence's global log (``ctx.persist.read_all``, in commit order) from the last event it read (``nextPosition``):
ConversationCreated gives the conversation and its tenant, TurnAdmitted its turns and last activity. A page load
reads only the events appended since the previous one (the first load on a replica reads the log once). A
persistence-side index per tenant would be the scalable answer for very large logs.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

CONVERSATION_STREAM = "conversation:"
ADMISSIONS_STREAM = "conversation-turns:"
PAGE_BYTES = 768 * 1024


@dataclass
class Entry:
    conversation_id: str
    tenant: str
    title: str | None
    created_at: str | None
    turns: int = 0
    last_activity: str | None = None


@dataclass
class ConversationIndex:
    rpc: Any
    position: int = 0
    entries: dict[str, Entry] = field(default_factory=dict)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def refresh(self) -> None:
        async with self._lock:
            while True:
                page = await self.rpc.call("ctx.persist.read_all",
                                           {"afterPosition": self.position, "maxBytes": PAGE_BYTES}, timeout=30)
                for e in page["events"]:
                    self.apply(e)
                self.position = page["nextPosition"]  # positions do not increase along the log: the cursor
                if not page.get("more") or not page["events"]:
                    return

    def apply(self, e: dict[str, Any]) -> None:
        stream, d = e.get("streamId", ""), e.get("data") or {}
        if e["type"] == "ConversationCreated" and stream.startswith(CONVERSATION_STREAM):
            cid = d.get("conversationId") or stream.removeprefix(CONVERSATION_STREAM)
            self.entries[cid] = Entry(cid, d.get("tenantId", "default"), d.get("title"), e.get("recordedAt"),
                                      last_activity=e.get("recordedAt"))
        elif e["type"] == "TurnAdmitted" and stream.startswith(ADMISSIONS_STREAM):
            entry = self.entries.get(stream.removeprefix(ADMISSIONS_STREAM))
            if entry is not None:
                entry.turns += 1
                entry.last_activity = e.get("recordedAt")

    async def of_tenant(self, tenant: str) -> list[Entry]:
        await self.refresh()
        mine = [e for e in self.entries.values() if e.tenant == tenant]
        return sorted(mine, key=lambda e: e.last_activity or "", reverse=True)
