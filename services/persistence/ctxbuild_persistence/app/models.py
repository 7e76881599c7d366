"""The generated contract models (``ctxbuild_codec.models``) as the persistence service takes and returns them.

Where persistence stores or serves the caller's JSON byte for byte — event ``data`` and ``metadata``, a turn's
messages and usage, a stored event, a history row — the field stays that JSON: parsing it into a model and dumping
it again could reorder keys (``metadata``, a message's own key order is served back) or reformat values
(``recordedAt``), and stored bytes must not change. Everything else is the generated model as is. ``@rpc`` has
already validated the request against the JSON Schema; these subclasses only decide what is parsed.
"""

from __future__ import annotations

from typing import Annotated, Any

from ctxbuild_codec.models.events.envelope import RecordedEvent
from ctxbuild_codec.models.subjects.ctx_persist_append_batch_request import PersistAppendBatchRequest
from ctxbuild_codec.models.subjects.ctx_persist_append_request import Event, PersistAppendRequest
from ctxbuild_codec.models.subjects.ctx_persist_complete_turn_request import PersistCompleteTurnRequest
from ctxbuild_codec.models.subjects.ctx_persist_history_reply import PersistHistoryReply
from ctxbuild_codec.models.subjects.ctx_persist_read_all_reply import PersistReadAllReply
from ctxbuild_codec.models.subjects.ctx_persist_read_stream_reply import PersistReadStreamReply
from pydantic import Field

JSON = dict[str, Any]  # a JSON object kept as the caller sent it (key order included)


class AppendEvent(Event):
    metadata: JSON | None = None


class AppendRequest(PersistAppendRequest):
    events: Annotated[list[AppendEvent], Field(max_length=1000, min_length=1)]


class AppendBatchRequest(PersistAppendBatchRequest):
    appends: Annotated[list[AppendRequest], Field(max_length=64, min_length=1)]


class CompleteTurnRequest(PersistCompleteTurnRequest):
    messages: Annotated[list[JSON], Field(min_length=1)]
    usage: JSON | None = None
    metadata: JSON | None = None
    turnAppend: AppendRequest | None = None  # the turn's own events, in the same commit (persist_lane)
    alsoAppend: Annotated[list[AppendRequest], Field(max_length=16, min_length=1)] | None = None  # other streams
    endNotice: JSON | None = None  # published as the runner built it (persist_lane)


class StoredEvent(RecordedEvent):
    """An event as the store holds it: ``data`` and ``metadata`` as appended, ``recordedAt`` as Postgres wrote it."""

    eventId: str
    data: JSON
    metadata: JSON
    recordedAt: str


class ReadStreamReply(PersistReadStreamReply):
    events: list[StoredEvent]


class ReadAllReply(PersistReadAllReply):
    events: list[StoredEvent]


class HistoryReply(PersistHistoryReply):
    messages: list[JSON]
