"""The conversation projection, as pure logic: a batch of events (global order) + what the projection already
holds → the rows to write. The adapter (``adapters/projection.py``) loads the inputs, writes the output and
moves the tracking position in the same transaction.

Tables (migration 0002): ``conversations`` (one head per conversation stream), ``messages`` (the tree: rows
with the same ``parent_id`` are siblings, e.g. from regenerate), ``compaction_summaries`` (at their boundary
message), ``attachments`` (the authoritative list) and ``file_references`` (attachments and archived tool
outputs per message).

The rules are exactly those of the fold (``domain/conversation.py``) — first message per id, first attachment
per handle, first summary per boundary, a message without ``parentId`` hangs under the previously added one —
and every value comes from the events (positions, versions), never from the clock, so rebuilding from the
event log gives the same rows as the live projector.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ctxbuild_platform.text import LONE_SURROGATE, first_bad_text

from .conversation import (
    ATTACHMENT_FIELDS,
    attachment_refs_of,
    persisted_uris_of,
    referenced_bytes,
    resolve_message,
)

CONVERSATION_PREFIX = "conversation:"
PROJECTION = "conversation"  # its row in persistence.projection_tracking


@dataclass(frozen=True, slots=True)
class LogEvent:
    position: int
    stream_id: str
    version: int
    type: str
    data: Mapping[str, Any] | None  # None for streams this projection does not read (not even decoded)
    tx: int = 0  # the writing transaction: the log's order is (tx, position)

    @property
    def cursor(self) -> tuple[int, int]:
        return (self.tx, self.position)


@dataclass(slots=True)
class ConvHead:
    conversation_id: str
    version: int
    first_position: int
    last_position: int
    created: bool = False
    title: str | None = None
    settings: Any = None
    last_message_id: str | None = None
    message_count: int = 0
    attachment_count: int = 0


@dataclass(frozen=True, slots=True)
class MessageRow:
    conversation_id: str
    message_id: str
    seq: int
    parent_id: str | None
    role: str
    turn_id: str | None
    body: dict[str, Any]
    usage: Any
    position: int

    @property
    def clear_context(self) -> bool:
        """A clear-context marker (the turn-start walk stops there); as Postgres casts ``body->>'clearContext'``."""
        value = self.body.get("clearContext")
        return value is True or (not isinstance(value, bool) and value is not None and
                                 str(value).strip().lower() in ("t", "true", "y", "yes", "on", "1"))

    def size_bytes(self, body_text: str) -> int:
        """The row's read cost: its body's JSON bytes plus the parts a content reference stands for."""
        return len(body_text.encode("utf-8")) + referenced_bytes(self.body)


@dataclass(frozen=True, slots=True)
class SummaryRow:
    conversation_id: str
    boundary_id: str
    summary: str
    turn_id: str | None
    summarizer: str | None
    folded_count: int | None
    position: int


@dataclass(frozen=True, slots=True)
class AttachmentRow:
    conversation_id: str
    handle: str
    seq: int
    sha256: str
    display_name: str
    media_type: str
    size: int
    uri: str | None
    position: int

    def reply(self) -> dict[str, Any]:
        """The attachment as ``ctx.persist.history`` lists it (the fold keeps ATTACHMENT_FIELDS)."""
        full = {"sha256": self.sha256, "handle": self.handle, "displayName": self.display_name,
                "mediaType": self.media_type, "size": self.size}
        return {k: full[k] for k in ATTACHMENT_FIELDS}


@dataclass(frozen=True, slots=True)
class FileRefRow:
    conversation_id: str
    message_id: str
    kind: str  # attachment | tool_output
    ref: str
    sha256: str | None
    tool_call_id: str | None
    position: int


@dataclass
class Known:
    """Keys already in the projection, loaded for the keys a batch touches (first one wins)."""

    messages: set[tuple[str, str]] = field(default_factory=set)
    handles: set[tuple[str, str]] = field(default_factory=set)
    boundaries: set[tuple[str, str]] = field(default_factory=set)


@dataclass
class Changes:
    heads: dict[str, ConvHead] = field(default_factory=dict)  # touched conversations, final state
    messages: list[MessageRow] = field(default_factory=list)
    summaries: list[SummaryRow] = field(default_factory=list)
    attachments: list[AttachmentRow] = field(default_factory=list)
    file_refs: list[FileRefRow] = field(default_factory=list)
    last_position: int | None = None  # the tracking position after this batch


@dataclass(frozen=True)
class Keys:
    """What the adapter must load before :func:`project` can run on a batch."""

    conversations: list[str]
    messages: list[tuple[str, str]]
    handles: list[tuple[str, str]]
    boundaries: list[tuple[str, str]]


def conversation_of(stream_id: str) -> str | None:
    return stream_id[len(CONVERSATION_PREFIX):] if stream_id.startswith(CONVERSATION_PREFIX) else None


def _messages_of(ev: LogEvent) -> list[tuple[Mapping[str, Any], str | None]]:
    data = ev.data or {}
    if ev.type == "UserMessageAdded":
        m = data.get("message")
        return [(m, None)] if isinstance(m, Mapping) else []
    if ev.type == "AssistantMessageCompleted":
        turn_id = data.get("turnId")
        return [(m, turn_id) for m in data.get("messages") or [] if isinstance(m, Mapping)]
    return []


def keys_of(events: Iterable[LogEvent]) -> Keys:
    convs: dict[str, None] = {}
    msgs: dict[tuple[str, str], None] = {}
    handles: dict[tuple[str, str], None] = {}
    bounds: dict[tuple[str, str], None] = {}
    for ev in events:
        cid = conversation_of(ev.stream_id)
        if cid is None:
            continue
        convs.setdefault(cid, None)
        for m, _ in _messages_of(ev):
            msgs.setdefault((cid, m["id"]), None)
        data = ev.data or {}
        if ev.type == "AttachmentAdded" and isinstance(data.get("attachment"), Mapping):
            handles.setdefault((cid, data["attachment"]["handle"]), None)
        elif ev.type == "CompactionSummaryRecorded":
            bounds.setdefault((cid, data["boundaryId"]), None)
    return Keys(list(convs), list(msgs), list(handles), list(bounds))


def project(events: Sequence[LogEvent], heads: Mapping[str, ConvHead], known: Known) -> Changes:
    """Apply a batch (in position order) on top of the stored ``heads``/``known`` (neither is mutated)."""
    out = Changes()
    seen = Known(set(known.messages), set(known.handles), set(known.boundaries))
    for ev in events:
        out.last_position = ev.position
        cid = conversation_of(ev.stream_id)
        if cid is None:
            continue  # turn streams and others: only the tracking position moves
        head = out.heads.get(cid)
        if head is None:
            stored = heads.get(cid)
            head = dataclasses.replace(stored) if stored is not None else ConvHead(
                cid, version=0, first_position=ev.position, last_position=ev.position)
            out.heads[cid] = head
        head.version = max(head.version, ev.version)
        head.last_position = ev.position
        data = ev.data or {}
        if ev.type == "ConversationCreated":
            if not head.created:
                head.created, head.title, head.settings = True, data.get("title"), data.get("settings")
        elif ev.type in ("UserMessageAdded", "AssistantMessageCompleted"):
            for message, turn_id in _messages_of(ev):
                key = (cid, message["id"])
                if key in seen.messages:
                    continue
                seen.messages.add(key)
                msg = resolve_message(message, head.last_message_id, turn_id)
                head.message_count += 1
                head.last_message_id = msg["id"]
                out.messages.append(MessageRow(
                    cid, msg["id"], head.message_count, msg.get("parentId"), msg["role"], msg.get("turnId"),
                    msg, msg.get("usage"), ev.position))
                out.file_refs.extend(_file_refs(cid, msg, ev.position))
        elif ev.type == "AttachmentAdded":
            att = data["attachment"]
            key = (cid, att["handle"])
            if key not in seen.handles:
                seen.handles.add(key)
                head.attachment_count += 1
                out.attachments.append(AttachmentRow(
                    cid, att["handle"], head.attachment_count, att["sha256"], att["displayName"], att["mediaType"],
                    att["size"], att.get("uri"), ev.position))
        elif ev.type == "CompactionSummaryRecorded":
            key = (cid, data["boundaryId"])
            if key not in seen.boundaries:
                seen.boundaries.add(key)
                out.summaries.append(SummaryRow(cid, data["boundaryId"], data["summary"], data.get("turnId"),
                                                data.get("summarizer"), data.get("foldedCount"), ev.position))
    return out


def _file_refs(cid: str, msg: Mapping[str, Any], position: int) -> list[FileRefRow]:
    rows: dict[tuple[str, str], FileRefRow] = {}
    for handle, sha in attachment_refs_of(msg):
        rows.setdefault(("attachment", handle),
                        FileRefRow(cid, msg["id"], "attachment", handle, sha, None, position))
    for uri, sha, call_id in persisted_uris_of(msg):
        rows.setdefault(("tool_output", uri), FileRefRow(cid, msg["id"], "tool_output", uri, sha, call_id, position))
    return list(rows.values())


# ---------------------------------------------------------------- what can never be projected

# the projection's text columns, per row kind (Postgres text cannot hold NUL)
_TEXT_FIELDS: dict[type, tuple[str, ...]] = {
    ConvHead: ("conversation_id", "title", "last_message_id"),
    MessageRow: ("message_id", "parent_id", "role", "turn_id"),
    SummaryRow: ("boundary_id", "summary", "turn_id", "summarizer"),
    AttachmentRow: ("handle", "sha256", "display_name", "media_type", "uri"),
    FileRefRow: ("message_id", "kind", "ref", "sha256", "tool_call_id"),
}


def lone_surrogate_at(value: Any, where: str = "data") -> str | None:
    """The path of the first string (key or value) holding a lone UTF-16 surrogate: such text cannot be encoded
    as UTF-8, so no reader could ever get the event back."""
    found = first_bad_text(value, where, LONE_SURROGATE)
    if found is None:
        return None
    return f"{found.path} (a key)" if found.in_key else found.path


def unprojectable(ev: LogEvent) -> str | None:
    """Why the conversation projection can never apply ``ev`` (None: it can). Asked at append time (such an
    event is refused) and by the projector (such an event is parked). Rows are stored as the projection makes
    them: a NUL character in one of their text columns, a lone surrogate anywhere, or a shape the projection
    cannot read is fatal; JSON columns (message bodies, settings) keep NUL characters as ``\\u0000``."""
    if (where := lone_surrogate_at(ev.data)) is not None:
        return f"{ev.type}: {where} holds a lone UTF-16 surrogate (not encodable as UTF-8)"
    if conversation_of(ev.stream_id) is None:
        return None
    try:
        ch = project([ev], {}, Known())
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        return f"{ev.type}: malformed for the projection ({type(exc).__name__}: {exc})"[:500]
    rows: list[Any] = [*ch.heads.values(), *ch.messages, *ch.summaries, *ch.attachments, *ch.file_refs]
    for row in rows:
        for name in _TEXT_FIELDS[type(row)]:
            value = getattr(row, name)
            if isinstance(value, str) and "\x00" in value:
                return f"{ev.type}: a NUL character in {type(row).__name__}.{name} (a Postgres text column)"
            if value is not None and not isinstance(value, str):
                return f"{ev.type}: {type(row).__name__}.{name} is a {type(value).__name__}, not text"
    return None
