"""Persistence as seen from compaction: the path to the anchor, storing a summary once, reading a turn back."""

from __future__ import annotations

import uuid
from typing import Any

from ctxbuild_codec.turn_start import read_window
from ctxbuild_platform.rpc import RpcClient

# event ids of stored summaries are derived from (conversation, boundary): a retry, or a second replica folding
# the same boundary, appends the same id and persistence keeps the first (write once)
SUMMARY_NS = uuid.UUID("6f1c0c8e-7d1b-4d3f-9a55-2f0e8c1b7a10")
FOLD_EVENT = "InLoopFoldRecorded"


def summary_event_id(conversation_id: str, boundary_id: str) -> str:
    return str(uuid.uuid5(SUMMARY_NS, f"{conversation_id}\0{boundary_id}"))


class History:
    def __init__(self, client: RpcClient, timeout_s: float, append_timeout_s: float = 10.0) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.append_timeout_s = append_timeout_s

    async def history(self, conversation_id: str, anchor_id: str | None = None, *,
                      max_messages: int | None = None) -> dict[str, Any]:
        """What a turn start reads (`ctx.persist.history`, window ``turn-start``): the path from the deepest
        compaction boundary (or the last clear-context marker) to the anchor — or, with ``max_messages``, the
        last rows back to a user row — following the byte-bounded pages (``ctxbuild_codec.turn_start.pages``,
        the runner reads it the same way). O(the window), not O(history). A RemoteError (typed, with its
        retryable flag) propagates to our caller."""
        return await read_window(lambda payload: self.client.call("ctx.persist.history", payload,
                                                                  timeout=self.timeout_s),
                                 conversation_id, anchor_id, max_messages=max_messages)

    async def store_summary(self, conversation_id: str, data: dict[str, Any]) -> bool:
        """Append CompactionSummaryRecorded to `conversation:<id>`; True when this call stored it, False when the
        boundary already had one (the first summary per boundary wins)."""
        reply = await self.client.call("ctx.persist.append", {
            "streamId": f"conversation:{conversation_id}", "expectedVersion": None,
            "events": [{"eventId": summary_event_id(conversation_id, data["boundaryId"]),
                        "type": "CompactionSummaryRecorded", "data": data,
                        "metadata": {"producer": "compaction", "correlationId": conversation_id}}]},
            timeout=self.append_timeout_s)
        return not reply.get("duplicates")

    async def last_fold(self, turn_id: str) -> dict[str, Any] | None:
        """The newest InLoopFoldRecorded of `turn:<id>` (a resumed turn's checkpoint), or None."""
        found = None
        version = 1
        while True:
            page = await self.client.call("ctx.persist.read_stream",
                                          {"streamId": f"turn:{turn_id}", "fromVersion": version},
                                          timeout=self.timeout_s)
            events = page.get("events") or []
            for ev in events:
                if ev.get("type") == FOLD_EVENT:
                    found = ev["data"]
            if not events or not page.get("more"):  # pages are cut by bytes: follow them to the end
                return found
            version = page["nextVersion"]

