"""NATS request/reply handlers of the persistence service (queue group ``persistence``). Thin: ``@rpc`` validates
the request against its contract and parses it into the generated model; the app (``app/``) does the work and
returns the reply model.

| subject                   | does                                                           |
|---------------------------|----------------------------------------------------------------|
| ``ctx.persist.append``      | append events (expected version, idempotent by event id)     |
| ``ctx.persist.append_batch`` | append to several streams in one commit, all or nothing    |
| ``ctx.persist.read_stream`` | a stream's events from a version, or its last event           |
| ``ctx.persist.read_all``    | the global log after an event's position, in commit order    |
| ``ctx.persist.history``     | a conversation's path to an anchor + what compaction needs    |
| ``ctx.persist.complete_turn`` | the persist lane: trim + offload, then AssistantMessageCompleted |
"""

from __future__ import annotations

from ctxbuild_codec.models.subjects.ctx_persist_append_batch_reply import PersistAppendBatchReply
from ctxbuild_codec.models.subjects.ctx_persist_append_reply import PersistAppendReply
from ctxbuild_codec.models.subjects.ctx_persist_complete_turn_reply import PersistCompleteTurnReply
from ctxbuild_codec.models.subjects.ctx_persist_history_request import PersistHistoryRequest
from ctxbuild_codec.models.subjects.ctx_persist_read_all_request import PersistReadAllRequest
from ctxbuild_codec.models.subjects.ctx_persist_read_stream_request import PersistReadStreamRequest
from ctxbuild_platform.rpc import rpc
from faststream.nats import NatsBroker

from .app import EventLog, History, PersistLane
from .app.models import (
    AppendBatchRequest,
    AppendRequest,
    CompleteTurnRequest,
    HistoryReply,
    ReadAllReply,
    ReadStreamReply,
)
from .settings import Settings

QUEUE = "persistence"


def register(broker: NatsBroker, settings: Settings, events: EventLog, history: History,
             lane: PersistLane | None = None) -> None:
    workers = settings.max_workers

    @rpc(broker, "ctx.persist.append", queue=QUEUE, max_workers=workers)
    async def append(req: AppendRequest) -> PersistAppendReply:
        """Append events to a stream with optimistic concurrency; idempotent by event id."""
        return await events.append(req)

    @rpc(broker, "ctx.persist.append_batch", queue=QUEUE, max_workers=workers)
    async def append_batch(req: AppendBatchRequest) -> PersistAppendBatchReply:
        """Append to several streams in one transaction, all or nothing; each group as ``ctx.persist.append``."""
        return await events.append_batch(req)

    @rpc(broker, "ctx.persist.read_stream", queue=QUEUE, max_workers=workers)
    async def read_stream(req: PersistReadStreamRequest) -> ReadStreamReply:
        """A page of a stream's events from a version (default 1), oldest first, cut at a byte budget, plus the
        stream's last version and where to continue; with ``last``, only the stream's last event."""
        return await events.read_stream(req)

    @rpc(broker, "ctx.persist.read_all", queue=QUEUE, max_workers=workers)
    async def read_all(req: PersistReadAllRequest) -> ReadAllReply:
        """Events of every stream after the event at a position, in commit order; never skips a later commit."""
        return await events.read_all(req)

    @rpc(broker, "ctx.persist.history", queue=QUEUE, max_workers=workers)
    async def conversation_history(req: PersistHistoryRequest) -> HistoryReply:
        """One page of a conversation's path root → anchor (default: the last message), walked back from the
        anchor within a byte budget (``window: "turn-start"``: only back to the deepest compaction boundary or
        clear-context marker; ``maxMessages``: back to that many rows), its attachments, and what compaction needs
        (usage of the last step, summaries, archived output URIs) — of the messages in the page. Read from the
        projection (read-your-writes, bounded wait), folded from the events when it is behind or failing."""
        return await history.read(req)

    if lane is not None:
        @rpc(broker, "ctx.persist.complete_turn", queue=QUEUE, max_workers=workers)
        async def complete_turn(req: CompleteTurnRequest) -> PersistCompleteTurnReply:
            """The persist lane (SPEC §7): oversized tool outputs → blobs + envelopes, then one
            AssistantMessageCompleted event on the conversation stream."""
            return await lane.complete_turn(req)
