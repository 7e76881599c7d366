"""ctx.compact.turn_start against the real persistence service: real events in, a real decision out."""

from __future__ import annotations

import uuid

import pytest
from ctxbuild_platform.errors import RemoteError

pytestmark = pytest.mark.integration

SHA = "c" * 64
URI = "context://vfs/vfs_0123456789abcdef.txt"


def filler(n: int) -> str:
    return "lorem " * n


def text(t):
    return [{"type": "text", "text": t}]


@pytest.fixture(scope="module")
def services(start_service):
    start_service("persistence")
    start_service("compaction")


async def append(rpc, conversation_id, *events):
    await rpc.call("ctx.persist.append", {
        "streamId": f"conversation:{conversation_id}", "expectedVersion": None,
        "events": [{"eventId": str(uuid.uuid4()), "type": t, "data": d} for t, d in events]})


async def seed_conversation(rpc) -> str:
    """Two finished turns (one with a tool exchange and an attachment) and the new user message: ≈ 3,500 tokens."""
    cid = f"conv-{uuid.uuid4()}"
    await append(
        rpc, cid,
        ("ConversationCreated", {"conversationId": cid, "title": "compaction test"}),
        ("AttachmentAdded", {"attachment": {"sha256": SHA, "handle": "report.pdf", "displayName": "report.pdf",
                                            "mediaType": "application/pdf", "size": 2048}}),
        ("UserMessageAdded", {"message": {
            "id": "u1", "parentId": None, "role": "user",
            "parts": [*text("Please review the attached report. " + filler(480)),
                      {"type": "file", "handle": "report.pdf", "displayName": "report.pdf",
                       "mediaType": "application/pdf", "sha256": SHA, "size": 2048}]}}),
        ("AssistantMessageCompleted", {"turnId": "turn-1", "messages": [
            {"id": "a1", "role": "assistant", "parts": [
                *text("Searching the web for context. " + filler(480)),
                {"type": "tool-call", "toolCallId": "c1", "toolName": "web_search", "input": {"q": "report"}}]},
            {"id": "t1", "role": "tool", "parts": [
                {"type": "tool-result", "toolCallId": "c1", "toolName": "web_search",
                 "output": {"type": "text", "value": filler(1_000)},
                 "offload": {"mode": "offloaded", "uri": URI, "totalChars": 60_000, "totalLines": 900}}]},
            {"id": "a2", "role": "assistant", "parts": text("The report is consistent. " + filler(800))}]}),
        ("UserMessageAdded", {"message": {"id": "u2", "role": "user",
                                          "parts": text("Check section two. " + filler(100))}}),
        ("AssistantMessageCompleted", {"turnId": "turn-2", "messages": [
            {"id": "a3", "role": "assistant", "parts": text("Section two adds up. " + filler(200))}]}),
        ("UserMessageAdded", {"message": {"id": "u3", "role": "user",
                                          "parts": text("Summarize the findings. " + filler(100))}}),
    )
    return cid


async def test_small_window_compacts_large_window_serves(services, rpc):
    cid = await seed_conversation(rpc)

    small = await rpc.call("ctx.compact.turn_start", {"conversationId": cid, "settings": {"contextWindow": 4_000}})
    d = small["decision"]
    assert d["status"] == "compacted" and d["phase"] == "turn-start"
    assert (d["trigger"], d["keepBudget"]) == (3_200, 1_200) and d["estimatedTokens"] > 3_200
    assert d["boundaryId"] == "a2" and d["foldedCount"] == 4
    assert d["postTokens"] < d["estimatedTokens"]
    ids = [m["id"] for m in small["messages"]]
    assert ids == ["compaction:a2", "u2", "a3", "u3"]
    summary = small["messages"][0]
    assert summary["role"] == "user"
    body = summary["parts"][0]["text"]
    assert "- User: Please review the attached report. [attached: report.pdf]" in body
    assert "[called tools: web_search]" in body
    assert body.endswith("[Files attached in this conversation remain readable in full via the read_file tool: "
                         "report.pdf]\n\n[Tool output archived from this conversation remains readable in full "
                         f"via the fs_read tool at: {URI}]")
    # finding #2: the attachment's message is folded, the attachment stays readable
    assert small["retained"] == {"fileAttachments": [{"sha256": SHA, "handle": "report.pdf",
                                                      "displayName": "report.pdf"}],
                                 "persistedUris": [URI]}

    again = await rpc.call("ctx.compact.turn_start", {"conversationId": cid, "settings": {"contextWindow": 4_000}})
    assert again["messages"][0] == summary  # deterministic bytes

    large = await rpc.call("ctx.compact.turn_start",
                           {"conversationId": cid, "settings": {"contextWindow": 200_000, "reservation": 8_000}})
    assert large["decision"]["status"] == "serve" and large["decision"]["reason"] == "under-trigger"
    assert [m["id"] for m in large["messages"]] == ["u1", "a1", "t1", "a2", "u2", "a3", "u3"]
    assert large["retained"] == small["retained"]


async def test_anchor_off_and_window_settings(services, rpc):
    cid = await seed_conversation(rpc)
    anchored = await rpc.call("ctx.compact.turn_start",
                              {"conversationId": cid, "anchorId": "u2", "settings": {"contextWindow": 100_000}})
    assert [m["id"] for m in anchored["messages"]] == ["u1", "a1", "t1", "a2", "u2"]
    off = await rpc.call("ctx.compact.turn_start",
                         {"conversationId": cid, "settings": {"contextWindow": 4_000, "compressEnabled": False}})
    assert off["decision"]["status"] == "serve" and off["decision"]["reason"] == "compaction-disabled"
    assert len(off["messages"]) == 7
    window = await rpc.call("ctx.compact.turn_start", {"conversationId": cid, "settings": {"maxMessages": 2}})
    assert [m["id"] for m in window["messages"]] == ["u2", "a3", "u3"]
    assert window["retained"] == {"fileAttachments": [], "persistedUris": []}


async def test_stored_summary_is_served(services, rpc):
    cid = await seed_conversation(rpc)
    await append(rpc, cid, ("CompactionSummaryRecorded", {"boundaryId": "a2", "summary": "- User: asked for a review."}))
    reply = await rpc.call("ctx.compact.turn_start", {"conversationId": cid, "settings": {"contextWindow": 100_000}})
    assert reply["decision"]["status"] == "serve"
    assert [m["id"] for m in reply["messages"]] == ["compaction:a2", "u2", "a3", "u3"]
    assert "- User: asked for a review." in reply["messages"][0]["parts"][0]["text"]


async def test_unknown_conversation_is_a_typed_error(services, rpc):
    with pytest.raises(RemoteError) as err:
        await rpc.call("ctx.compact.turn_start", {"conversationId": f"conv-{uuid.uuid4()}"})
    assert err.value.code == "not-found" and err.value.retryable is False
