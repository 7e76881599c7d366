"""NATS request/reply handlers of the persistence service (queue group ``persistence``). Thin: contract
validation is done by ``@rpc``; the store and the domain do the work.

| subject                   | does                                                           |
|---------------------------|----------------------------------------------------------------|
| ``ctx.persist.append``      | append events (expected version, idempotent by event id)     |
| ``ctx.persist.read_stream`` | a stream's events from a version                              |
| ``ctx.persist.read_all``    | every stream's events after a global position (gap-free)     |
| ``ctx.persist.history``     | a conversation's path to an anchor + what compaction needs    |
| ``ctx.persist.complete_turn`` | the persist lane: trim + offload, then AssistantMessageCompleted |

``ctx.persist.history`` reads the projection (read-your-writes: it waits, bounded, for the projection to reach
the conversation's last event) and folds the events instead when the projection is behind or failing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import Any

import structlog
from ctxbuild_blobclient import content_ref
from ctxbuild_platform import contracts
from ctxbuild_platform.errors import DependencyUnavailable, InvalidPayload, NotFound, ServiceError
from ctxbuild_platform.rpc import rpc
from faststream.nats import NatsBroker
from opentelemetry.propagate import inject

from .adapters.event_store import EventStore, dumps
from .adapters.projection import Projector, read_history, stream_head
from .domain.append import NewEvent
from .domain.conversation import (
    PathWindow,
    branches,
    conversation_stream,
    fold,
    history_reply,
    page_info,
    path_to,
    window_of,
)
from .domain.projection import LogEvent, lone_surrogate_at, unprojectable
from .persist_lane import PersistLane
from .settings import Settings

QUEUE = "persistence"
log = structlog.get_logger("persistence")


def event_contract(event_type: str) -> str | None:
    name = f"events/{event_type}.json"
    return name if contracts.has_contract(name) else None


def to_new_events(raw_events: list[dict[str, Any]], max_event_bytes: int,
                  stream_id: str | None = None) -> list[NewEvent]:
    """Request events → NewEvent, validating each ``data`` against ``contracts/events/<Type>.json`` when it
    exists, refusing what could be stored but never read or projected (a lone surrogate anywhere; on a
    conversation stream, a NUL character in a field the projection keeps as text: SPEC §15.3), and stamping the
    current trace context into ``metadata`` (caller-provided keys win)."""
    trace: dict[str, str] = {}
    inject(trace)
    out: list[NewEvent] = []
    if stream_id is not None and ("\x00" in stream_id or lone_surrogate_at(stream_id) is not None):
        raise InvalidPayload("streamId holds a NUL character or a lone surrogate")
    for i, ev in enumerate(raw_events):
        name = event_contract(ev["type"])
        if name is not None:
            try:
                contracts.validate(name, ev["data"])
            except InvalidPayload as exc:
                raise InvalidPayload(f"events/{i} ({ev['type']}): {exc.message}",
                                     details={**(exc.details or {}), "eventIndex": i}) from exc
        reason = unprojectable(LogEvent(0, stream_id or "", 0, ev["type"], ev["data"])) or (
            f"{ev['type']}: {where} holds a lone UTF-16 surrogate (not encodable as UTF-8)"
            if (where := lone_surrogate_at(ev.get("metadata", {}), "metadata")) is not None else None)
        if reason is not None:
            raise InvalidPayload(f"events/{i} ({ev['type']}): cannot be stored: {reason}",
                                 details={"eventIndex": i})
        metadata = {**trace, **ev.get("metadata", {})}
        size = len(dumps(ev["data"]).encode()) + len(dumps(metadata).encode())
        if size > max_event_bytes:
            raise InvalidPayload(f"events/{i} ({ev['type']}): {size} bytes of JSON, over {max_event_bytes}",
                                 details={"eventIndex": i, "bytes": size, "limit": max_event_bytes})
        out.append(NewEvent(event_id=ev["eventId"].lower(), type=ev["type"], data=ev["data"], metadata=metadata))
    return out


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
    for i, msg in zip(todo, await asyncio.gather(*(one(i) for i in todo))):
        out[i] = msg
    return out


def register(broker: NatsBroker, settings: Settings, store: EventStore, on_appended: Callable[[], None],
             projector: Projector | None = None, lane: PersistLane | None = None,
             blobs: content_ref.BlobPort | None = None) -> None:
    workers = settings.max_workers

    def limit_of(payload: dict[str, Any]) -> int:
        return min(payload.get("limit", settings.read_default_limit), settings.read_max_limit)

    def bytes_of(payload: dict[str, Any]) -> int:
        return min(payload.get("maxBytes", settings.read_default_bytes), settings.read_max_bytes)

    @rpc(broker, "ctx.persist.append", queue=QUEUE, max_workers=workers)
    async def append(payload: dict[str, Any]) -> dict[str, Any]:
        """Append events to a stream with optimistic concurrency; idempotent by event id."""
        events = to_new_events(payload["events"], settings.max_event_bytes, payload["streamId"])
        result = await store.append(payload["streamId"], payload["expectedVersion"], events)
        if result["duplicates"] < len(events):
            on_appended()
        return result

    @rpc(broker, "ctx.persist.read_stream", queue=QUEUE, max_workers=workers)
    async def read_stream(payload: dict[str, Any]) -> dict[str, Any]:
        """A page of a stream's events from a version (default 1), oldest first, cut at a byte budget, plus the
        stream's last version and where to continue."""
        return await store.read_stream(payload["streamId"], payload.get("fromVersion", 1), limit_of(payload),
                                       bytes_of(payload))

    @rpc(broker, "ctx.persist.read_all", queue=QUEUE, max_workers=workers)
    async def read_all(payload: dict[str, Any]) -> dict[str, Any]:
        """Events of every stream after a global position, in position order; never skips a later commit."""
        return await store.read_all(payload.get("afterPosition", 0), limit_of(payload), bytes_of(payload))

    @rpc(broker, "ctx.persist.history", queue=QUEUE, max_workers=workers)
    async def conversation_history(payload: dict[str, Any]) -> dict[str, Any]:
        """One page of a conversation's path root → anchor (default: the last message), walked back from the
        anchor within a byte budget (``window: "turn-start"``: only back to the deepest compaction boundary or
        clear-context marker; ``maxMessages``: back to that many rows), its attachments, and what compaction needs
        (usage of the last step, summaries, archived output URIs) — of the messages in the page."""
        cid, anchor = payload["conversationId"], payload.get("anchorId")
        with_branches = bool(payload.get("includeBranches"))
        window = PathWindow(bytes_of(payload), stop_at_summary=payload.get("window") == "turn-start",
                            max_messages=int(payload.get("maxMessages") or 0))
        resolve = partial(resolve_messages, blobs, cid, settings.ref_resolve_concurrency)
        stream = conversation_stream(cid)
        try:
            if projector is not None and settings.history_from_projection:
                target = await stream_head(store.db, stream)
                near = target - projector.position <= settings.history_max_wait_lag
                if target and near and await projector.wait_for(target, settings.history_projection_wait_s):
                    reply = await read_history(store.db, cid, anchor, target, with_branches, window, resolve)
                    if reply is not None:
                        return reply
                if target:
                    log.warning("history-folded", conversation=cid, projection=projector.position, needed=target)
            events = await store.stream_events(stream)
            conv = fold(cid, events)
            if conv.event_count == 0:
                raise NotFound(f"conversation {cid!r} has no events", details={"conversationId": cid})
            messages, start, cleared = window_of(path_to(conv, anchor), window)
            messages = await resolve(messages)
            reply = history_reply(cid, conv.version, conv.title, messages,
                                  [dict(a) for a in conv.attachments.values()], source="fold",
                                  page=page_info(messages, start, cleared))
            if with_branches:
                reply["branches"] = branches(conv, [m["id"] for m in reply["messages"]])
            return reply
        except ServiceError as exc:
            if exc.code != "not-found":
                log.warning("history-failed", conversation=cid, anchor=anchor, code=exc.code, error=exc.message[:300])
            raise
        except Exception as exc:
            log.error("history-failed", conversation=cid, anchor=anchor, error=f"{type(exc).__name__}: {exc}"[:300])
            raise

    if lane is not None:
        @rpc(broker, "ctx.persist.complete_turn", queue=QUEUE, max_workers=workers)
        async def complete_turn(payload: dict[str, Any]) -> dict[str, Any]:
            """The persist lane (SPEC §7): oversized tool outputs → blobs + envelopes, then one
            AssistantMessageCompleted event on the conversation stream."""
            return await lane.complete_turn(payload)
