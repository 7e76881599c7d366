"""What the conversation projection can never apply (refused at append, parked by the projector), and the message
row columns the projector computes since migration 0004 (the same values the generated columns had)."""

from __future__ import annotations

import json

import pytest
from ctxbuild_persistence.domain.projection import LogEvent, MessageRow, lone_surrogate_at, unprojectable

CONV = "conversation:conv_1"


def ev(type_: str, data: dict, stream: str = CONV) -> LogEvent:
    return LogEvent(1, stream, 1, type_, data)


def user(text: str = "hi", **extra) -> dict:
    return {"message": {"id": "m1", "role": "user", "parts": [{"type": "text", "text": text}], **extra}}


@pytest.mark.parametrize("event, why", [
    (ev("ConversationCreated", {"conversationId": "c", "title": "a\x00b"}), "ConvHead.title"),
    (ev("UserMessageAdded", {"message": {"id": "m\x00", "role": "user", "parts": []}}), "last_message_id"),
    (ev("AttachmentAdded", {"attachment": {"sha256": "s", "handle": "h", "displayName": "a\x00", "mediaType": "t",
                                           "size": 1}}), "AttachmentRow.display_name"),
    (ev("CompactionSummaryRecorded", {"boundaryId": "b", "summary": "s\x00"}), "SummaryRow.summary"),
    (ev("UserMessageAdded", user("x\ud800")), "lone UTF-16 surrogate"),
    (ev("TurnQueued", {"k\udc00": 1}, stream="turn:t1"), "lone UTF-16 surrogate"),
    (ev("AttachmentAdded", {"attachment": {"handle": "h"}}), "malformed"),
    (ev("UserMessageAdded", {"message": {"id": 7, "role": "user", "parts": []}}), "not text"),
])
def test_what_the_projection_can_never_apply_is_named(event, why):
    reason = unprojectable(event)
    assert reason is not None and why in reason and event.type in reason


@pytest.mark.parametrize("event", [
    ev("ConversationCreated", {"conversationId": "c", "title": "ünï ☃ 😀"}),
    ev("UserMessageAdded", user("a NUL inside a JSON body is kept: \x00")),
    ev("TurnQueued", {"text": "turn streams are not projected: \x00"}, stream="turn:t1"),
])
def test_what_it_can_apply_passes(event):
    assert unprojectable(event) is None


def test_a_lone_surrogate_is_found_with_its_path():
    assert lone_surrogate_at({"a": [{"b": "ok"}, {"c": "\ud83d"}]}) == "data.a[1].c"
    assert lone_surrogate_at(json.loads('{"a": "\\ud83d\\ude00"}')) is None  # JSON decodes a pair to one char


def row(body: dict) -> MessageRow:
    return MessageRow("c", "m", 1, None, "user", None, body, None, 1)


@pytest.mark.parametrize("value, clear", [(True, True), (False, False), (None, False), ("true", True), ("no", False),
                                          (1, True), (0, False)])
def test_clear_context_reads_like_the_old_cast(value, clear):
    body = {"id": "m", "role": "user", "parts": []}
    if value is not None:
        body["clearContext"] = value
    assert row(body).clear_context is clear


def test_size_bytes_counts_the_stored_json_and_a_referenced_parts_size():
    inline = {"id": "m", "parts": [{"type": "text", "text": "ü"}]}
    text = json.dumps(inline, ensure_ascii=False, separators=(",", ":"))
    assert row(inline).size_bytes(text) == len(text.encode())
    ref = {"id": "m", "parts": {"contentRef": {"sha256": "s", "size": 5000}}}
    text = json.dumps(ref, separators=(",", ":"))
    assert row(ref).size_bytes(text) == len(text.encode()) + 5000
