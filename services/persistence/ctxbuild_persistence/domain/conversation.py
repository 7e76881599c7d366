"""Fold the events of stream ``conversation:<id>`` into messages, attachments and compaction summaries, and
compute the path served for a turn (SPEC §1: a conversation is a tree; a turn serves root → anchor).

Walking-skeleton depth: history is folded on read; a projection table can later hold the same fold.

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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

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


def _add_message(conv: Conversation, message: Mapping[str, Any], turn_id: str | None = None) -> None:
    mid = message["id"]
    if mid in conv.messages:
        return
    msg = dict(message)
    if "parentId" not in msg:
        msg["parentId"] = conv.last_message_id
    if turn_id is not None and "turnId" not in msg:
        msg["turnId"] = turn_id
    conv.messages[mid] = msg


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


def history(conversation_id: str, events: Iterable[Mapping[str, Any]],
            anchor_id: str | None = None) -> dict[str, Any]:
    """The ``ctx.persist.history`` reply for a conversation's events (raises NotFound for no events)."""
    conv = fold(conversation_id, events)
    if conv.event_count == 0:
        raise NotFound(f"conversation {conversation_id!r} has no events",
                       details={"conversationId": conversation_id})
    reply: dict[str, Any] = {
        "conversationId": conversation_id,
        "version": conv.version,
        "messages": path_to(conv, anchor_id),
        "attachments": [dict(a) for a in conv.attachments.values()],
    }
    if conv.title is not None:
        reply["title"] = conv.title
    return reply
