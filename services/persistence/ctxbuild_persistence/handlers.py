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

from collections.abc import Callable
from typing import Any

import structlog
from ctxbuild_platform import contracts
from ctxbuild_platform.errors import InvalidPayload
from ctxbuild_platform.rpc import rpc
from faststream.nats import NatsBroker
from opentelemetry.propagate import inject

from .adapters.event_store import EventStore, dumps
from .adapters.projection import Projector, read_history, stream_head
from .domain.append import NewEvent
from .domain.conversation import branches, conversation_stream, fold, history
from .persist_lane import PersistLane
from .settings import Settings

QUEUE = "persistence"
log = structlog.get_logger("persistence")


def event_contract(event_type: str) -> str | None:
    name = f"events/{event_type}.json"
    return name if contracts.has_contract(name) else None


def to_new_events(raw_events: list[dict[str, Any]], max_event_bytes: int) -> list[NewEvent]:
    """Request events → NewEvent, validating each ``data`` against ``contracts/events/<Type>.json`` when it
    exists and stamping the current trace context into ``metadata`` (caller-provided keys win)."""
    trace: dict[str, str] = {}
    inject(trace)
    out: list[NewEvent] = []
    for i, ev in enumerate(raw_events):
        name = event_contract(ev["type"])
        if name is not None:
            try:
                contracts.validate(name, ev["data"])
            except InvalidPayload as exc:
                raise InvalidPayload(f"events/{i} ({ev['type']}): {exc.message}",
                                     details={**(exc.details or {}), "eventIndex": i}) from exc
        metadata = {**trace, **ev.get("metadata", {})}
        size = len(dumps(ev["data"]).encode()) + len(dumps(metadata).encode())
        if size > max_event_bytes:
            raise InvalidPayload(f"events/{i} ({ev['type']}): {size} bytes of JSON, over {max_event_bytes}",
                                 details={"eventIndex": i, "bytes": size, "limit": max_event_bytes})
        out.append(NewEvent(event_id=ev["eventId"].lower(), type=ev["type"], data=ev["data"], metadata=metadata))
    return out


def register(broker: NatsBroker, settings: Settings, store: EventStore, on_appended: Callable[[], None],
             projector: Projector | None = None, lane: PersistLane | None = None) -> None:
    workers = settings.max_workers

    def limit_of(payload: dict[str, Any]) -> int:
        return min(payload.get("limit", settings.read_default_limit), settings.read_max_limit)

    def bytes_of(payload: dict[str, Any]) -> int:
        return min(payload.get("maxBytes", settings.read_default_bytes), settings.read_max_bytes)

    @rpc(broker, "ctx.persist.append", queue=QUEUE, max_workers=workers)
    async def append(payload: dict[str, Any]) -> dict[str, Any]:
        """Append events to a stream with optimistic concurrency; idempotent by event id."""
        events = to_new_events(payload["events"], settings.max_event_bytes)
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
        """A conversation's messages on the path root → anchor (default: the last message), its attachments,
        and what compaction needs (usage of the last step, summaries, archived output URIs)."""
        cid, anchor = payload["conversationId"], payload.get("anchorId")
        with_branches = bool(payload.get("includeBranches"))
        stream = conversation_stream(cid)
        if projector is not None and settings.history_from_projection:
            target = await stream_head(store.db, stream)
            near = target - projector.position <= settings.history_max_wait_lag
            if target and near and await projector.wait_for(target, settings.history_projection_wait_s):
                reply = await read_history(store.db, cid, anchor, target, with_branches)
                if reply is not None:
                    return reply
            if target:
                log.warning("history-folded", conversation=cid, projection=projector.position, needed=target)
        events = await store.stream_events(stream)
        reply = history(cid, events, anchor)
        if with_branches:
            reply["branches"] = branches(fold(cid, events), [m["id"] for m in reply["messages"]])
        return reply

    if lane is not None:
        @rpc(broker, "ctx.persist.complete_turn", queue=QUEUE, max_workers=workers)
        async def complete_turn(payload: dict[str, Any]) -> dict[str, Any]:
            """The persist lane (SPEC §7): oversized tool outputs → blobs + envelopes, then one
            AssistantMessageCompleted event on the conversation stream."""
            return await lane.complete_turn(payload)
