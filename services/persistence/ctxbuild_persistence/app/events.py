"""The event log use cases: ``ctx.persist.append`` (validate, refuse what could never be read back, stamp the trace
context, append), ``ctx.persist.append_batch`` (the same for several streams, one commit; then the message the
request hands on, if any), ``ctx.persist.read_stream`` (a page, or the stream's last event) and
``ctx.persist.read_all``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ctxbuild_codec.models.subjects.ctx_persist_append_batch_reply import PersistAppendBatchReply
from ctxbuild_codec.models.subjects.ctx_persist_append_reply import PersistAppendReply
from ctxbuild_codec.models.subjects.ctx_persist_read_all_request import PersistReadAllRequest
from ctxbuild_codec.models.subjects.ctx_persist_read_stream_request import PersistReadStreamRequest
from ctxbuild_platform import contracts
from ctxbuild_platform.errors import InvalidPayload
from opentelemetry.propagate import inject

from ..adapters.enqueue import Enqueuer
from ..adapters.event_store import AppendPart, EventStore, encode
from ..domain.append import NewEvent
from ..domain.projection import LogEvent, lone_surrogate_at, unprojectable
from ..settings import Settings
from .models import AppendBatchRequest, AppendEvent, AppendRequest, ReadAllReply, ReadStreamReply


def event_contract(event_type: str) -> str | None:
    name = f"events/{event_type}.json"
    return name if contracts.has_contract(name) else None


def to_new_events(events: Sequence[AppendEvent], max_event_bytes: int, stream_id: str | None = None) -> list[NewEvent]:
    """Request events → NewEvent, validating each ``data`` against ``contracts/events/<Type>.json`` when it
    exists, refusing what could be stored but never read or projected (a lone surrogate anywhere; on a
    conversation stream, a NUL character in a field the projection keeps as text: SPEC §15.3), and stamping the
    current trace context into ``metadata`` (caller-provided keys win). ``data`` is stored as the caller sent it; the
    JSON text measured against ``max_event_bytes`` is the text stored."""
    trace: dict[str, str] = {}
    inject(trace)
    out: list[NewEvent] = []
    if stream_id is not None and ("\x00" in stream_id or lone_surrogate_at(stream_id) is not None):
        raise InvalidPayload("streamId holds a NUL character or a lone surrogate")
    for i, ev in enumerate(events):
        name = event_contract(ev.type)
        if name is not None:
            try:
                contracts.validate(name, ev.data)
            except InvalidPayload as exc:
                raise InvalidPayload(f"events/{i} ({ev.type}): {exc.message}",
                                     details={**(exc.details or {}), "eventIndex": i}) from exc
        given = ev.metadata or {}
        reason = unprojectable(LogEvent(0, stream_id or "", 0, ev.type, ev.data)) or (
            f"{ev.type}: {where} holds a lone UTF-16 surrogate (not encodable as UTF-8)"
            if (where := lone_surrogate_at(given, "metadata")) is not None else None)
        if reason is not None:
            raise InvalidPayload(f"events/{i} ({ev.type}): cannot be stored: {reason}", details={"eventIndex": i})
        metadata = {**trace, **given}
        data_json, data_bytes = encode(ev.data)
        metadata_json, metadata_bytes = encode(metadata)
        size = data_bytes + metadata_bytes
        if size > max_event_bytes:
            raise InvalidPayload(f"events/{i} ({ev.type}): {size} bytes of JSON, over {max_event_bytes}",
                                 details={"eventIndex": i, "bytes": size, "limit": max_event_bytes})
        out.append(NewEvent(event_id=str(ev.eventId), type=ev.type, data=ev.data, metadata=metadata,
                            data_json=data_json, metadata_json=metadata_json))  # the text measured is stored
    return out


@dataclass
class EventLog:
    """Append and read, with the service's limits (page size and byte budget capped by the settings)."""

    store: EventStore
    settings: Settings
    on_appended: Callable[[], None]
    enqueuer: Enqueuer | None = None  # none: a request's ``enqueue`` is refused

    def limit_of(self, limit: int | None) -> int:
        return min(limit if limit is not None else self.settings.read_default_limit, self.settings.read_max_limit)

    def bytes_of(self, max_bytes: int | None) -> int:
        s = self.settings
        return min(max_bytes if max_bytes is not None else s.read_default_bytes, s.read_max_bytes)

    async def append(self, req: AppendRequest) -> PersistAppendReply:
        events = to_new_events(req.events, self.settings.max_event_bytes, req.streamId)
        result = await self.store.append(req.streamId, req.expectedVersion, events)
        if result["duplicates"] < len(events):
            self.on_appended()
        return PersistAppendReply.model_validate(result)

    async def append_batch(self, req: AppendBatchRequest) -> PersistAppendBatchReply:
        """Every group checked like a single append first (nothing is written when one is refused), then one
        store request: one commit, all or nothing; one wake-up of the background loops for the batch. ``enqueue``:
        published once the commit has landed (a refused batch publishes nothing), before the reply; a retried batch
        publishes again (JetStream drops the repeat by its msgId)."""
        if req.enqueue is not None:
            if self.enqueuer is None:
                raise InvalidPayload("enqueue is not enabled on this service")
            self.enqueuer.check(req.enqueue.subject)
        seen: set[str] = set()
        parts: list[AppendPart] = []
        for g, group in enumerate(req.appends):
            if group.streamId in seen:
                raise InvalidPayload(f"appends/{g}: stream {group.streamId!r} appears twice in the batch",
                                     details={"groupIndex": g, "streamId": group.streamId})
            seen.add(group.streamId)
            try:
                events = to_new_events(group.events, self.settings.max_event_bytes, group.streamId)
            except InvalidPayload as exc:
                raise InvalidPayload(f"appends/{g}: {exc.message}",
                                     details={**(exc.details or {}), "groupIndex": g}) from exc
            parts.append(AppendPart(group.streamId, group.expectedVersion, events))
        results = await self.store.append_batch(parts)
        if any(r["duplicates"] < len(p.events) for r, p in zip(results, parts, strict=True)):
            self.on_appended()
        reply: dict = {"results": results}
        if req.enqueue is not None and self.enqueuer is not None:
            reply["enqueued"] = await self.enqueuer.publish(req.enqueue.subject, req.enqueue.msgId, req.enqueue.body)
        return PersistAppendBatchReply.model_validate(reply)

    async def read_stream(self, req: PersistReadStreamRequest) -> ReadStreamReply:
        if req.last:
            return ReadStreamReply.model_validate(await self.store.read_stream_last(req.streamId))
        page = await self.store.read_stream(req.streamId, req.fromVersion or 1, self.limit_of(req.limit),
                                            self.bytes_of(req.maxBytes))
        return ReadStreamReply.model_validate(page)

    async def read_all(self, req: PersistReadAllRequest) -> ReadAllReply:
        page = await self.store.read_all(req.afterPosition or 0, self.limit_of(req.limit), self.bytes_of(req.maxBytes))
        return ReadAllReply.model_validate(page)
