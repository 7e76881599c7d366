"""Fold the events of stream ``conversation:<id>`` into messages, attachments and compaction summaries, and
compute the path served for a turn (SPEC §1: a conversation is a tree; a turn serves root → anchor).

The same rules feed the projection tables (``domain/projection.py``, maintained by the projector): the fold
here is the reference the projection is tested against, and the fallback when the projection is behind.

Events (contracts/events/<Type>.json):
- ``ConversationCreated {conversationId, title?, settings?}``
- ``UserMessageAdded {message}``
- ``AttachmentAdded {attachment: {sha256, handle, displayName, mediaType, size, uri?}}``
- ``AssistantMessageCompleted {turnId, messages: [...]}`` — the assistant and tool messages of a turn, in order
- ``CompactionSummaryRecorded {boundaryId, summary}`` — sets ``compactionSummary`` on the boundary message

Rules:
- a message without a ``parentId`` key hangs under the message folded just before it (a linear conversation
  needs no bookkeeping); an explicit ``parentId: null`` is a root. The reply always carries the resolved
  ``parentId``;
- messages of an ``AssistantMessageCompleted`` without ``turnId`` get the event's ``turnId``;
- the first message with a given id wins (a later one with the same id is ignored), likewise the first
  attachment per handle and the first summary per boundary — the summary is written once and served many
  times, so its bytes never change once recorded;
- unknown event types are ignored (forward compatible).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ctxbuild_codec.records import archived_blobs, archived_uris, usage_of
from ctxbuild_platform.errors import NotFound

ATTACHMENT_FIELDS = ("sha256", "handle", "displayName", "mediaType", "size")


def conversation_stream(conversation_id: str) -> str:
    return f"conversation:{conversation_id}"


@dataclass
class Conversation:
    conversation_id: str
    version: int = 0  # stream version the fold is at (0 = no events)
    event_count: int = 0
    created: bool = False
    title: str | None = None
    settings: dict[str, Any] | None = None
    messages: dict[str, dict[str, Any]] = field(default_factory=dict)  # id → message, in fold order
    attachments: dict[str, dict[str, Any]] = field(default_factory=dict)  # handle → attachment, in order
    summaries: dict[str, str] = field(default_factory=dict)  # boundary message id → summary

    @property
    def last_message_id(self) -> str | None:
        return next(reversed(self.messages), None)


def resolve_message(message: Mapping[str, Any], previous_id: str | None,
                    turn_id: str | None = None) -> dict[str, Any]:
    """The message as stored and served: ``parentId`` resolved (no key → the previous message), ``turnId`` from
    the event when the message has none. Key order: the message's own, then the added keys."""
    msg = dict(message)
    if "parentId" not in msg:
        msg["parentId"] = previous_id
    if turn_id is not None and "turnId" not in msg:
        msg["turnId"] = turn_id
    return msg


def _add_message(conv: Conversation, message: Mapping[str, Any], turn_id: str | None = None) -> None:
    mid = message["id"]
    if mid in conv.messages:
        return
    conv.messages[mid] = resolve_message(message, conv.last_message_id, turn_id)


def apply(conv: Conversation, event_type: str, data: Mapping[str, Any], version: int | None = None) -> None:
    """Fold one event into ``conv`` (in place)."""
    conv.event_count += 1
    if event_type == "ConversationCreated":
        if not conv.created:
            conv.created = True
            conv.title = data.get("title")
            conv.settings = data.get("settings")
    elif event_type == "UserMessageAdded":
        _add_message(conv, data["message"])
    elif event_type == "AssistantMessageCompleted":
        for m in data.get("messages", []):
            _add_message(conv, m, data.get("turnId"))
    elif event_type == "AttachmentAdded":
        att = data["attachment"]
        conv.attachments.setdefault(att["handle"], {k: att[k] for k in ATTACHMENT_FIELDS if k in att})
    elif event_type == "CompactionSummaryRecorded":
        conv.summaries.setdefault(data["boundaryId"], data["summary"])
    if version is not None:
        conv.version = max(conv.version, version)


def fold(conversation_id: str, events: Iterable[Mapping[str, Any]]) -> Conversation:
    """Events as read from the store: mappings with ``type``, ``data`` and (optionally) ``version``, in order."""
    conv = Conversation(conversation_id)
    for ev in events:
        apply(conv, ev["type"], ev["data"], ev.get("version"))
    return conv


def path_to(conv: Conversation, anchor_id: str | None = None) -> list[dict[str, Any]]:
    """Messages from the root to the anchor (default: the last message folded), oldest first.

    Each is a fresh dict with the resolved ``parentId`` and, on a boundary row, ``compactionSummary``. A
    ``parentId`` naming no known message ends the walk (that message is treated as the root)."""
    if anchor_id is None:
        anchor_id = conv.last_message_id
        if anchor_id is None:
            return []
    elif anchor_id not in conv.messages:
        raise NotFound(f"message {anchor_id!r} is not in conversation {conv.conversation_id!r}",
                       details={"conversationId": conv.conversation_id, "anchorId": anchor_id})
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    cur: str | None = anchor_id
    while cur is not None and cur in conv.messages and cur not in seen:
        seen.add(cur)
        msg = dict(conv.messages[cur])
        if cur in conv.summaries:
            msg["compactionSummary"] = conv.summaries[cur]
        out.append(msg)
        cur = msg.get("parentId")
    out.reverse()
    return out


@dataclass(frozen=True, slots=True)
class PathWindow:
    """Which part of the path root → anchor one ``ctx.persist.history`` reply holds.

    Walking back from the anchor, a page takes whole messages while they fit ``max_bytes`` (the anchor always).
    ``stop_at_summary`` (turn start, SPEC §8.3): the walk ends at the deepest compaction boundary or at the last
    clear-context marker, whichever comes first — both included, nothing older is served. ``max_messages``
    (SPEC §8.4): it ends at a clear-context marker or once ``max_messages`` rows are taken and the last one is a
    ``user`` row."""

    max_bytes: int
    stop_at_summary: bool = False
    max_messages: int = 0

    def stops_at(self, message: Mapping[str, Any], is_boundary: bool, taken: int) -> bool:
        windowed = self.stop_at_summary or self.max_messages > 0
        return (windowed and bool(message.get("clearContext"))) or (self.stop_at_summary and is_boundary) or (
            self.max_messages > 0 and taken >= self.max_messages and message.get("role") == "user")


def referenced_bytes(message: Mapping[str, Any]) -> int:
    """The size of the parts a content reference stands for (history resolves them before replying); 0 when the
    parts are inline."""
    parts = message.get("parts")
    ref = parts.get("contentRef") if isinstance(parts, Mapping) else None
    size = ref.get("size") if isinstance(ref, Mapping) else None
    return size if isinstance(size, int) else 0


def message_bytes(message: Mapping[str, Any]) -> int:
    """What a message costs in a reply: its JSON, plus the parts a content reference stands for."""
    body = {k: v for k, v in message.items() if k != "compactionSummary"}
    return len(json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")) + \
        referenced_bytes(message)


def window_of(path: list[dict[str, Any]], window: PathWindow) -> tuple[list[dict[str, Any]], str, bool]:
    """The page of ``path`` (root → anchor) a reply holds: (messages, start, cleared_before).

    ``start``: ``root`` (the page reaches the root), ``summary`` / ``clear`` / ``limit`` (the window's own end),
    or ``page`` (the budget cut it: continue with the first message's ``parentId`` as the anchor).
    ``cleared_before``: a clear-context marker lies before a ``summary`` start."""
    out: list[dict[str, Any]] = []
    used, start = 0, "root"
    for i in range(len(path) - 1, -1, -1):
        msg = path[i]
        size = message_bytes(msg)
        if out and used + size > window.max_bytes:
            start = "page"
            break
        out.append(msg)
        used += size
        if window.stops_at(msg, "compactionSummary" in msg, len(out)):
            start = "clear" if msg.get("clearContext") else "summary" if (
                window.stop_at_summary and "compactionSummary" in msg) else "limit"
            break
    out.reverse()
    cleared = start == "summary" and any(m.get("clearContext") for m in path[:len(path) - len(out)])
    return out, start, cleared


def history(conversation_id: str, events: Iterable[Mapping[str, Any]],
            anchor_id: str | None = None) -> dict[str, Any]:
    """The ``ctx.persist.history`` reply for a conversation's events (raises NotFound for no events)."""
    conv = fold(conversation_id, events)
    if conv.event_count == 0:
        raise NotFound(f"conversation {conversation_id!r} has no events",
                       details={"conversationId": conversation_id})
    return history_reply(conversation_id, conv.version, conv.title, path_to(conv, anchor_id),
                         [dict(a) for a in conv.attachments.values()], source="fold")


def page_info(messages: list[dict[str, Any]], start: str, cleared_before: bool) -> dict[str, Any]:
    """The paging fields of a history reply: where the page starts and how to continue."""
    info: dict[str, Any] = {"start": start, "more": start == "page"}
    if start == "page":
        info["nextAnchorId"] = messages[0].get("parentId")
    if start == "summary":
        info["clearedBefore"] = cleared_before
    return info


def persisted_uris_of(message: Mapping[str, Any]) -> list[tuple[str, str | None, str | None]]:
    """``(uri, sha256, toolCallId)`` of every blob ctxbuild archived a tool output of this message in
    (``ctxbuild_codec.records.archived_blobs``: an in-flight offload's uri, each codec blob and the original; a
    persisted envelope's vfsFilename, blobRefs and original). Typed provenance only: text that merely looks like
    a marker is never a source (SPEC §1)."""
    return [(b.uri, b.sha256, b.tool_call_id) for part in message.get("parts") or [] for b in archived_blobs(part)]


def attachment_refs_of(message: Mapping[str, Any]) -> list[tuple[str, str | None]]:
    """``(handle, sha256)`` of the file parts of a message."""
    return [(p["handle"], _sha(p.get("sha256"))) for p in message.get("parts") or []
            if isinstance(p, Mapping) and p.get("type") == "file" and isinstance(p.get("handle"), str)]


def _sha(value: Any) -> str | None:
    return value if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef"
                                                                        for c in value) else None


def history_extras(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """What the compaction service needs besides the rows (SPEC §8), computed over the whole path:
    ``lastUsage`` (the newest assistant row with provider usage), ``summaries`` (where stored summaries sit on the
    path — index into ``messages``, oldest first; the deepest is the one that counts, its text is the row's
    ``compactionSummary``) and ``persistedUris`` (archived outputs on the path, in order of first appearance)."""
    last_usage = None
    for m in reversed(messages):
        if (usage := usage_of(m)) is not None:
            last_usage = {"messageId": m["id"], "usage": dict(usage)}
            break
    summaries = [{"boundaryId": m["id"], "index": i}
                 for i, m in enumerate(messages) if isinstance(m.get("compactionSummary"), str)]
    return {"lastUsage": last_usage, "summaries": summaries, "persistedUris": archived_uris(messages)}


def history_reply(conversation_id: str, version: int, title: str | None, messages: list[dict[str, Any]],
                  attachments: list[dict[str, Any]], *, source: str,
                  page: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``ctx.persist.history`` reply, whichever way the rows were read (projection or fold). The extras
    (lastUsage, summaries, persistedUris) are those of the messages in this reply (this page)."""
    reply: dict[str, Any] = {
        "conversationId": conversation_id,
        "version": version,
        "messages": messages,
        "attachments": attachments,
    }
    if title is not None:
        reply["title"] = title
    reply["anchorId"] = messages[-1]["id"] if messages else None
    reply.update(history_extras(messages))
    reply["source"] = source
    reply.update(page or {"start": "root", "more": False})
    return reply


def branches(conv: Conversation, path_ids: list[str]) -> dict[str, list[str]]:
    """For each message on the path that has siblings (same parent — e.g. regenerated answers): the ids of all
    the siblings, itself included, in the order they were added."""
    by_parent: dict[str | None, list[str]] = {}
    for mid, msg in conv.messages.items():
        by_parent.setdefault(msg.get("parentId"), []).append(mid)
    out: dict[str, list[str]] = {}
    for mid in path_ids:
        group = by_parent.get(conv.messages[mid].get("parentId"), [])
        if len(group) > 1:
            out[mid] = list(group)
    return out
