"""How a turn start reads its window from `ctx.persist.history` (window ``turn-start``): the requests that follow
the byte-bounded pages, and the pages merged into one history. The compaction service and the turn runner read it
the same way; the call itself is the caller's (this module does no I/O)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

Page = dict[str, Any]


async def read_window(fetch: Callable[[dict[str, Any]], Awaitable[Page]], conversation_id: str,
                      anchor_id: str | None = None, *, max_messages: int | None = None) -> Page:
    """The path from the deepest compaction boundary (or the last clear-context marker) to the anchor — or, with
    ``max_messages``, the last rows back to a user row — following the pages. ``fetch`` makes one
    `ctx.persist.history` call; whatever it raises propagates."""
    pages: list[Page] = []
    anchor, taken = anchor_id, 0
    while True:
        payload: dict[str, Any] = {"conversationId": conversation_id}
        if anchor:
            payload["anchorId"] = anchor
        if max_messages:
            payload["maxMessages"] = max(1, max_messages - taken)
        else:
            payload["window"] = "turn-start"
        page = await fetch(payload)
        pages.append(page)
        taken += len(page["messages"])
        if not page.get("more") or not page.get("nextAnchorId"):
            return merge_pages(pages)
        anchor = page["nextAnchorId"]


def merge_pages(pages: list[Page]) -> Page:
    """History pages (newest first, as read) → one reply over their messages, oldest first: the newest page's
    head (version, attachments, anchor), the oldest page's start, the extras recomputed over the whole."""
    if len(pages) == 1:
        return pages[0]
    out = dict(pages[0])
    messages = [m for page in reversed(pages) for m in page["messages"]]
    out["messages"] = messages
    for key in ("start", "more", "nextAnchorId", "clearedBefore"):
        out.pop(key, None)
        if key in pages[-1]:
            out[key] = pages[-1][key]
    out["lastUsage"] = next((p["lastUsage"] for p in pages if p.get("lastUsage")), None)
    out["summaries"] = [{"boundaryId": m["id"], "index": i} for i, m in enumerate(messages)
                        if isinstance(m.get("compactionSummary"), str)]
    out["persistedUris"] = list(dict.fromkeys(u for page in reversed(pages) for u in page.get("persistedUris") or []))
    return out


def created_window(conversation_id: str, messages: list[dict[str, Any]]) -> Page:
    """The turn-start window of a conversation that holds just ``messages`` (one commit created it with them: no
    summary, no clear-context marker, no attachment, no usage, no archived output yet) — the page
    `ctx.persist.history` would return for it, without the read."""
    return {"conversationId": conversation_id, "version": 1 + len(messages), "messages": messages,
            "attachments": [], "anchorId": messages[-1]["id"], "lastUsage": None, "summaries": [],
            "persistedUris": [], "source": "fold", "start": "root", "more": False}
