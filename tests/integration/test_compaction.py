"""ctx.compact.turn_start / ctx.compact.in_loop against the real persistence service: real events in, a real
decision out, the summary stored once as an event and served to every later turn."""

from __future__ import annotations

import uuid

import pytest
from ctxbuild_compaction.domain import CONTINUE, PREAMBLE, split_stored
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
    start_service("blobstore")   # a fold's transcript is archived there (SPEC §15.2)
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
    assert "- User: Please review the attached report." in body and "[attached: report.pdf]" in body
    assert f"[called: web_search(q=report) → archived at {URI}]" in body
    # the folded span is archived as one transcript (SPEC §15.2): the row names it, the read scope retains it
    assert body.endswith("[Files attached in this conversation remain readable in full via the read_file tool: "
                         "report.pdf]\n\n[The full transcript of the folded part is readable via the fs_read tool "
                         f"at: {d['transcript']}]")
    assert d["stored"] is True and d["summarizer"] == "extractive"
    # finding #2: the attachment's message is folded, the attachment stays readable
    assert small["retained"] == {"fileAttachments": [{"sha256": SHA, "handle": "report.pdf",
                                                      "displayName": "report.pdf"}],
                                 "persistedUris": [URI, d["transcript"]]}
    page = await rpc.call("ctx.blob.fs_read", {"conversationId": cid, "uri": d["transcript"],
                                               "retained": small["retained"]})
    assert page["kind"] == "text" and [ln.split("\t")[1] for ln in page["text"].split("\n")
                                       if ln.split("\t")[1].startswith("### [")] == [
        "### [1] user u1", "### [2] assistant a1", "### [3] tool t1", "### [4] assistant a2"]

    # write once, serve many: the next turn serves the stored summary (no fold, no second event), same bytes
    again = await rpc.call("ctx.compact.turn_start", {"conversationId": cid, "settings": {"contextWindow": 4_000}})
    assert again["decision"]["status"] == "serve" and "stored" not in again["decision"]
    assert again["messages"] == small["messages"]
    events = (await rpc.call("ctx.persist.read_stream", {"streamId": f"conversation:{cid}"}))["events"]
    recorded = [e["data"] for e in events if e["type"] == "CompactionSummaryRecorded"]
    assert len(recorded) == 1 and recorded[0]["boundaryId"] == "a2" and recorded[0]["foldedCount"] == 4
    # stored with the row's attachment and archive lines: every later turn rebuilds the same bytes from it
    assert body == f"{PREAMBLE}\n\n{split_stored(recorded[0]['summary'])[0]}\n\n{CONTINUE}" + \
        split_stored(recorded[0]["summary"])[1]

    # a later attachment: the summary row's bytes do not change, the attachment is retained
    await append(rpc, cid, ("AttachmentAdded", {"attachment": {
        "sha256": "d" * 64, "handle": "late.csv", "displayName": "late.csv", "mediaType": "text/csv", "size": 9}}))
    later = await rpc.call("ctx.compact.turn_start", {"conversationId": cid, "settings": {"contextWindow": 200_000}})
    assert later["decision"]["status"] == "serve" and later["messages"][0] == summary
    assert [a["handle"] for a in later["retained"]["fileAttachments"]] == ["report.pdf", "late.csv"]
    assert [m["id"] for m in later["messages"]] == ["compaction:a2", "u2", "a3", "u3"]
    assert d["transcript"] in later["retained"]["persistedUris"]   # a later turn may still read it


async def test_large_window_serves_the_whole_path(services, rpc):
    cid = await seed_conversation(rpc)
    large = await rpc.call("ctx.compact.turn_start",
                           {"conversationId": cid, "settings": {"contextWindow": 200_000, "reservation": 8_000}})
    assert large["decision"]["status"] == "serve" and large["decision"]["reason"] == "under-trigger"
    assert [m["id"] for m in large["messages"]] == ["u1", "a1", "t1", "a2", "u2", "a3", "u3"]


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
    await append(rpc, cid, ("CompactionSummaryRecorded",
                            {"boundaryId": "a2", "summary": "- User: asked for a review."}))
    reply = await rpc.call("ctx.compact.turn_start", {"conversationId": cid, "settings": {"contextWindow": 100_000}})
    assert reply["decision"]["status"] == "serve"
    assert [m["id"] for m in reply["messages"]] == ["compaction:a2", "u2", "a3", "u3"]
    assert "- User: asked for a review." in reply["messages"][0]["parts"][0]["text"]


async def test_unknown_conversation_is_a_typed_error(services, rpc):
    with pytest.raises(RemoteError) as err:
        await rpc.call("ctx.compact.turn_start", {"conversationId": f"conv-{uuid.uuid4()}"})
    assert err.value.code == "not-found" and err.value.retryable is False


# ---------- in loop ----------

def page_turn(turn_id: str, steps: int) -> list[dict]:
    msgs = [{"id": "u9", "role": "user", "parts": text("Read the log page by page.")}]
    for i in range(1, steps + 1):
        msgs += [{"id": f"a{i}", "role": "assistant", "turnId": turn_id, "parts": [
                     {"type": "tool-call", "toolCallId": f"c{i}", "toolName": "read_file", "input": {"page": i}}]},
                 {"id": f"t{i}", "role": "tool", "turnId": turn_id, "parts": [
                     {"type": "tool-result", "toolCallId": f"c{i}", "toolName": "read_file",
                      "output": {"type": "text", "value": f"page {i} " + filler(700)}}]}]
    return msgs


async def test_in_loop_fold_checkpoint_and_read_back(services, rpc):
    cid, turn = f"conv-{uuid.uuid4()}", f"turn-{uuid.uuid4()}"
    msgs = page_turn(turn, 8)
    base = {"conversationId": cid, "turnId": turn, "step": 9, "fixedTokens": 200, "settings": {"contextWindow": 5_000}}
    small = await rpc.call("ctx.compact.in_loop", {**base, "messages": msgs[:5], "checkpoint": None})
    assert small["decision"]["status"] == "serve" and small["decision"]["summarizerCalls"] == 0
    assert small["checkpointChanged"] is False and small["messages"] == msgs[:5]

    folded = await rpc.call("ctx.compact.in_loop", {**base, "messages": msgs, "checkpoint": None})
    d, ck = folded["decision"], folded["checkpoint"]
    assert d["status"] == "compacted" and folded["checkpointChanged"] and d["postTokens"] <= d["trigger"]
    assert ck["consumedCount"] == d["consumedCount"] > 0
    # the task (the turn's user message) is pinned before the summary row, never folded
    assert folded["messages"][0] == msgs[0] and ck["taskId"] == msgs[0]["id"]
    assert folded["messages"][1]["id"] == f"compaction:{msgs[ck['consumedCount'] - 1]['id']}"

    # the runner records the checkpoint on the turn stream; a replica resuming the turn reads it back
    await rpc.call("ctx.persist.append", {"streamId": f"turn:{turn}", "expectedVersion": 0, "events": [
        {"eventId": str(uuid.uuid4()), "type": "TurnStarted",
         "data": {"turnId": turn, "conversationId": cid, "userMessageId": "u9"}},
        {"eventId": str(uuid.uuid4()), "type": "InLoopFoldRecorded", "data": {"turnId": turn, **ck, "step": 9}}]})
    resumed = await rpc.call("ctx.compact.in_loop", {**base, "messages": msgs})
    assert resumed["decision"]["checkpointReadBack"] is True and resumed["decision"]["status"] == "serve"
    assert resumed["messages"] == folded["messages"] and resumed["checkpoint"] == ck

    # only the unconsumed messages travel once the caller holds the checkpoint
    tail = await rpc.call("ctx.compact.in_loop", {**base, "offset": ck["consumedCount"],
                                                  "messages": msgs[ck["consumedCount"]:], "checkpoint": ck})
    assert tail["messages"] == folded["messages"]
    with pytest.raises(RemoteError) as err:
        await rpc.call("ctx.compact.in_loop", {**base, "offset": ck["consumedCount"] + 1,
                                               "messages": msgs[ck["consumedCount"] + 1:], "checkpoint": ck})
    assert err.value.code == "invalid-payload"
