"""``ctx.persist.history``: one page of a conversation's path root → anchor, folded from the events when the
conversation is short (``history_fold_max_events``: one statement, where the projection's read is a transaction of
several), else read from the projection (read-your-writes: it waits, bounded, for the projection to reach the
conversation's last event) or folded when the projection is behind, failing or disabled; message parts stored by
content reference are read back from the blob store."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import partial
from typing import Any

import structlog
from ctxbuild_blobclient import content_ref
from ctxbuild_codec.models.subjects.ctx_persist_history_request import PersistHistoryRequest
from ctxbuild_platform.errors import DependencyUnavailable, NotFound, ServiceError

from ..adapters.event_store import EventStore
from ..adapters.projection import Projector, read_history, stream_head
from ..domain.conversation import (
    PathWindow,
    branches,
    conversation_stream,
    fold,
    history_reply,
    page_info,
    path_to,
    window_of,
)
from ..settings import Settings
from .models import HistoryReply

log = structlog.get_logger("persistence")


async def resolve_messages(blobs: content_ref.BlobPort | None, conversation_id: str, concurrency: int,
                           messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with their parts read back where an event stored them by content reference (SPEC §15.1)."""
    todo = [i for i, m in enumerate(messages) if content_ref.is_ref(m.get("parts"))]
    if not todo:
        return messages
    if blobs is None:
        raise DependencyUnavailable("history: message parts are stored by reference and no blob store is set")
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int) -> dict[str, Any]:
        async with slots:
            try:
                return await content_ref.resolve_message(blobs, messages[i], conversation_id)
            except Exception as exc:
                ref = messages[i]["parts"]["contentRef"]
                log.warning("content-ref-unreadable", conversation=conversation_id, message=messages[i].get("id"),
                            uri=ref.get("uri"), error=f"{type(exc).__name__}: {exc}"[:300])
                raise DependencyUnavailable(f"message {messages[i].get('id')}: parts at {ref.get('uri')} could not "
                                            f"be read: {type(exc).__name__}") from exc

    out = list(messages)
    for i, msg in zip(todo, await asyncio.gather(*(one(i) for i in todo)), strict=True):
        out[i] = msg
    return out


@dataclass
class History:
    store: EventStore
    settings: Settings
    projector: Projector | None = None
    blobs: content_ref.BlobPort | None = None

    async def read(self, req: PersistHistoryRequest) -> HistoryReply:
        cid, anchor = req.conversationId, req.anchorId
        s = self.settings
        window = PathWindow(min(req.maxBytes if req.maxBytes is not None else s.read_default_bytes, s.read_max_bytes),
                            stop_at_summary=req.window == "turn-start", max_messages=req.maxMessages or 0)
        try:
            reply = await self._projected(cid, anchor, bool(req.includeBranches), window)
            if reply is None:
                reply = await self._folded(cid, anchor, bool(req.includeBranches), window)
        except ServiceError as exc:
            if exc.code != "not-found":
                log.warning("history-failed", conversation=cid, anchor=anchor, code=exc.code, error=exc.message[:300])
            raise
        except Exception as exc:
            log.error("history-failed", conversation=cid, anchor=anchor, error=f"{type(exc).__name__}: {exc}"[:300])
            raise
        return HistoryReply.model_validate(reply)

    def _resolve(self, cid: str):
        return partial(resolve_messages, self.blobs, cid, self.settings.ref_resolve_concurrency)

    async def _projected(self, cid: str, anchor: str | None, with_branches: bool,
                         window: PathWindow) -> dict[str, Any] | None:
        """The reply from the projection once it has the conversation's last event; None: fold instead."""
        projector, s = self.projector, self.settings
        if projector is None or not s.history_from_projection:
            return None
        head = await stream_head(self.store.db, conversation_stream(cid))
        if not head.version:
            return None  # no events: the fold says not-found
        if head.version <= s.history_fold_max_events:
            return None  # a short stream folds in one statement, for less than the projection's read transaction
        if max(projector.cursor, head.projected) < head.cursor:
            # positions are not ordered along the log, but near enough in time to tell a catch-up from a short lag
            near = head.cursor[1] - projector.position <= s.history_max_wait_lag
            if not (near and await projector.wait_for(head.cursor, s.history_projection_wait_s)):
                log.warning("history-folded", conversation=cid, projection=projector.position, needed=head.cursor[1])
                return None
        reply = await read_history(self.store.db, cid, anchor, head.cursor, with_branches, window, self._resolve(cid))
        if reply is None:
            log.warning("history-folded", conversation=cid, projection=projector.position, needed=head.cursor[1])
        return reply

    async def _folded(self, cid: str, anchor: str | None, with_branches: bool, window: PathWindow) -> dict[str, Any]:
        conv = fold(cid, await self.store.stream_events(conversation_stream(cid)))
        if conv.event_count == 0:
            raise NotFound(f"conversation {cid!r} has no events", details={"conversationId": cid})
        messages, start, cleared = window_of(path_to(conv, anchor), window)
        messages = await self._resolve(cid)(messages)
        reply = history_reply(cid, conv.version, conv.title, messages, [dict(a) for a in conv.attachments.values()],
                              source="fold", page=page_info(messages, start, cleared))
        if with_branches:
            reply["branches"] = branches(conv, [m["id"] for m in reply["messages"]])
        return reply
