"""The persist lane on the real stack (persistence + blob store + Postgres + S3 + NATS): oversized outputs are
stored as v1/v2 envelopes, their full texts are byte-exactly readable from the blob store by the conversation,
retries are idempotent, a failing blob store leaves the full outputs, a refused event stores nothing, and
finding #3 (read-tool echoes stored trimmed)."""

from __future__ import annotations

import hashlib
import json
import uuid

import asyncpg
import pytest
from ctxbuild_codec import envelopes
from ctxbuild_platform.errors import RemoteError

from tests.support.persistence import projected, projection_history

pytestmark = pytest.mark.integration

BIG = "".join(f"{i:05d} " + "lorem ipsum dolor sit amet " * 3 + "\n" for i in range(800))  # ~70k chars


@pytest.fixture(scope="module")
def services(start_service) -> None:
    start_service("blobstore")
    start_service("persistence")


def new_id() -> str:
    return str(uuid.uuid4())




def result(call: str, tool: str, output: dict, **extra) -> dict:
    return {"type": "tool-result", "toolCallId": call, "toolName": tool, "output": output, **extra}


async def read_blob(rpc, cid: str, uri: str, sha256: str) -> str:
    """The full text behind a URI, paged through ctx.blob.fs_read, checked against its sha256 (fs_read drops
    one trailing empty line, the hash decides whether the text ended with a newline)."""
    lines: list[str] = []
    offset, limit = 1, 2000
    while True:
        r = await rpc.call("ctx.blob.fs_read", {"conversationId": cid, "uri": uri, "offset": offset, "limit": limit})
        if r["kind"] == "error":
            if r["code"] == "output-too-large" and limit > 1:
                limit = max(1, limit // 2)
                continue
            raise AssertionError(r)
        if r["endLine"] >= r["startLine"]:
            lines += [row.split("\t", 1)[1] for row in r["text"].split("\n")]
        if r["endLine"] >= r["totalLines"]:
            break
        offset = r["endLine"] + 1
    body = "\n".join(lines)
    for candidate in (body, body + "\n"):
        if hashlib.sha256(candidate.encode()).hexdigest() == sha256:
            return candidate
    raise AssertionError(f"{uri}: the pages do not add up to blob {sha256}")


async def recover(rpc, cid: str, envelope: dict) -> dict:
    """The original output from its envelope and the blob store (SPEC §7 read-back)."""
    texts = {r["fileEntryId"]: await read_blob(rpc, cid, "context://vfs/" + r["vfsFilename"], r["fileEntryId"])
             for r in envelopes.blob_refs(envelope)}
    return envelopes.inflate(envelope, texts)


def sample_turn(turn_id: str) -> list[dict]:
    web = [{"id": "Qx7pL2aZ-1", "title": "One", "url": "https://one.example/a", "content": BIG + "web"},
           {"id": "Qx7pL2aZ-2", "title": "Two", "url": "https://two.example/b", "content": "short"}]
    return [
        {"id": f"{turn_id}-a1", "role": "assistant", "parentId": "u1", "parts": [
            {"type": "tool-call", "toolCallId": "k1", "toolName": "bash", "input": {"command": "cat log"}}]},
        {"id": f"{turn_id}-t1", "role": "tool", "parts": [
            result("k1", "bash", {"type": "text", "value": BIG}),
            result("k2", "web_search", {"type": "json", "value": web}),
            result("k3", "fs_read", {"type": "json", "value": {"text": BIG.upper(), "startLine": 1}}),
            result("k4", "read_file", {"type": "text", "value": BIG[::-1]}),
            result("k5", "bash", {"type": "text", "value": "ok"}),
        ]},
        {"id": f"{turn_id}-a2", "role": "assistant", "parts": [{"type": "text", "text": "done"}],
         "usage": {"inputTokens": 900, "outputTokens": 12}},
    ]


async def start_conversation(rpc) -> str:
    cid = new_id()
    await rpc.call("ctx.persist.append", {"streamId": f"conversation:{cid}", "expectedVersion": 0, "events": [
        {"eventId": new_id(), "type": "UserMessageAdded",
         "data": {"message": {"id": "u1", "role": "user", "parts": [{"type": "text", "text": "go"}]}}}]})
    return cid


async def test_oversized_outputs_become_envelopes_readable_in_full(services, rpc, stack):
    cid = await start_conversation(rpc)
    turn_id = new_id()
    messages = sample_turn(turn_id)
    req = {"conversationId": cid, "turnId": turn_id, "eventId": new_id(), "expectedVersion": 1,
           "messages": messages, "usage": {"inputTokens": 900, "outputTokens": 12}}
    res = await rpc.call("ctx.persist.complete_turn", req)
    assert res["append"]["fromVersion"] == 2 and res["append"]["duplicates"] == 0 and res["threshold"] == 50_000
    assert [(p["toolCallId"], p["outcome"], p["envelope"]) for p in res["parts"]] == [
        ("k1", "persisted", "v1"), ("k2", "persisted", "v2"), ("k3", "persisted", "v2"), ("k4", "persisted", "v1")]

    h = await rpc.call("ctx.persist.history", {"conversationId": cid})
    assert h["source"] == "fold" and [m["id"] for m in h["messages"]] == ["u1"] + [m["id"] for m in messages]
    await projected(stack, cid)
    from_projection = await projection_history(stack, cid)  # what the service folds, the projection holds too
    assert from_projection["source"] == "projection" and {**from_projection, "source": "fold"} == h
    stored = h["messages"][2]["parts"]
    assert [p["output"]["type"] for p in stored] == ["persisted"] * 4 + ["text"]
    assert stored[4] == messages[1]["parts"][4]
    # finding #3: the read tools' echoes are stored trimmed — fs_read's {text,…} through the text-field codec (its
    # identity fields stay), read_file's text through the opaque lane
    assert [r["key"] for r in stored[2]["output"]["value"]["blobRefs"]] == ["/text"]
    assert stored[2]["output"]["value"]["skeleton"]["startLine"] == 1
    assert stored[3]["output"]["value"]["shape"] == "text"
    assert h["lastUsage"] == {"messageId": f"{turn_id}-a2", "usage": {"inputTokens": 900, "outputTokens": 12}}
    expected_uris = [b["uri"] for p in res["parts"] for b in p["blobs"]]
    assert h["persistedUris"] == list(dict.fromkeys(expected_uris)) and len(h["persistedUris"]) == 4
    # every trimmed output comes back byte-exactly from the blob store (this conversation may read it)
    for part, original in zip(stored[:4], messages[1]["parts"][:4], strict=True):
        got = await recover(rpc, cid, part["output"]["value"])
        assert json.dumps(got) == json.dumps(original["output"])
    # another conversation may not
    other = await rpc.call("ctx.blob.fs_read", {"conversationId": new_id(), "uri": h["persistedUris"][0]})
    assert other["kind"] == "error" and other["code"] == "access-denied"

    conn = await asyncpg.connect(stack.env["CTX_DATABASE_URL"])
    try:
        size = await conn.fetchval("SELECT octet_length(data::text) FROM persistence.events WHERE event_id = $1",
                                   uuid.UUID(req["eventId"]))
        refs = await conn.fetch("SELECT ref, tool_call_id FROM persistence.file_references WHERE conversation_id = $1 "
                                "AND kind = 'tool_output' ORDER BY ref", cid)
        blob_refs = await conn.fetch("SELECT sha256, owner_kind, owner_id, role FROM blobstore.refs "
                                     "WHERE conversation_id = $1 ORDER BY sha256", cid)
    finally:
        await conn.close()
    raw = sum(len(json.dumps(p["output"])) for p in messages[1]["parts"])
    assert size < 15_000 < raw  # four ~70k outputs stored as excerpts + snippets
    assert sorted(r["ref"] for r in refs) == sorted(h["persistedUris"])
    shas = sorted({b["sha256"] for p in res["parts"] for b in p["blobs"]})
    assert [(r["sha256"], r["owner_kind"], r["owner_id"], r["role"]) for r in blob_refs] == [
        (s, "message", f"{turn_id}-t1", "tool_output") for s in shas]


async def test_a_retry_is_idempotent(services, rpc):
    cid = await start_conversation(rpc)
    turn_id = new_id()
    req = {"conversationId": cid, "turnId": turn_id, "eventId": new_id(), "expectedVersion": 1,
           "messages": sample_turn(turn_id)}
    first = await rpc.call("ctx.persist.complete_turn", req)
    again = await rpc.call("ctx.persist.complete_turn", req)
    assert again["append"]["duplicates"] == 1 and again["append"]["positions"] == first["append"]["positions"]
    assert again["parts"] == first["parts"]
    got = await rpc.call("ctx.persist.read_stream", {"streamId": f"conversation:{cid}"})
    assert [e["type"] for e in got["events"]] == ["UserMessageAdded", "AssistantMessageCompleted"]


async def test_a_refused_event_stores_nothing_and_releases_its_references(services, rpc, stack):
    cid = await start_conversation(rpc)
    turn_id = new_id()
    req = {"conversationId": cid, "turnId": turn_id, "eventId": new_id(), "expectedVersion": 0,  # stale version
           "messages": sample_turn(turn_id)}
    with pytest.raises(RemoteError) as exc:
        await rpc.call("ctx.persist.complete_turn", req)
    assert exc.value.code == "version-conflict"
    got = await rpc.call("ctx.persist.read_stream", {"streamId": f"conversation:{cid}"})
    assert [e["type"] for e in got["events"]] == ["UserMessageAdded"]
    conn = await asyncpg.connect(stack.env["CTX_DATABASE_URL"])
    try:
        left = await conn.fetchval("SELECT count(*) FROM blobstore.refs WHERE owner_id = $1", f"{turn_id}-t1")
    finally:
        await conn.close()
    assert left == 0  # released: the blobs are collectable (unless another owner still needs them)


async def test_blob_store_down_is_a_retryable_refusal(services, rpc, stack, start_service):
    """Events stay small (≤ 64 KiB): with the blob store down, four ~70k outputs can neither become envelopes
    nor travel by content reference, so the lane refuses with a retryable `unavailable` and stores nothing; the
    caller's retry with the same eventId succeeds once the blob store is back."""
    cid = await start_conversation(rpc)
    turn_id = new_id()
    messages = sample_turn(turn_id)
    req = {"conversationId": cid, "turnId": turn_id, "eventId": new_id(), "messages": messages}
    stack.stop("blobstore")
    try:
        with pytest.raises(RemoteError) as exc:
            await rpc.call("ctx.persist.complete_turn", req)
    finally:
        start_service("blobstore")
    assert exc.value.code == "unavailable" and exc.value.retryable
    got = await rpc.call("ctx.persist.read_stream", {"streamId": f"conversation:{cid}"})
    assert [e["type"] for e in got["events"]] == ["UserMessageAdded"]
    again = await rpc.call("ctx.persist.complete_turn", req)
    assert again["append"]["duplicates"] == 0
    assert [p["outcome"] for p in again["parts"]] == ["persisted"] * 4
    h = await rpc.call("ctx.persist.history", {"conversationId": cid})
    assert [m["id"] for m in h["messages"][1:]] == [m["id"] for m in messages]
    assert len(h["persistedUris"]) == 4


async def test_outputs_offloaded_in_flight_get_a_reference_owned_by_their_message(services, rpc, stack):
    """The in-flight lane stored the full text with a provisional reference tied to the turn; the stored message
    keeps the marker as is and its blob gains a tool_output reference owned by the message, so it outlives the
    turn's provisional reference."""
    from ctxbuild_codec import trim_inflight

    cid = await start_conversation(rpc)
    turn_id = new_id()
    put = await rpc.call("ctx.blob.put", {"content": BIG, "conversationId": cid, "role": "provisional",
                                          "owner": {"kind": "turn", "id": turn_id}})
    part = trim_inflight(result("k1", "bash", {"type": "text", "value": BIG}), 4800,
                         store=lambda b: put["uri"] if b.sha256 == put["sha256"] else None)
    assert part["offload"]["mode"] == "offloaded"
    tool_id = f"{turn_id}-t1"
    res = await rpc.call("ctx.persist.complete_turn", {
        "conversationId": cid, "turnId": turn_id, "eventId": new_id(), "messages": [
            {"id": f"{turn_id}-a1", "role": "assistant", "parts": [
                {"type": "tool-call", "toolCallId": "k1", "toolName": "bash", "input": {}}]},
            {"id": tool_id, "role": "tool", "parts": [part]}]})
    assert res["parts"] == [] and res["references"] == {"promoted": 1, "failed": 0}
    h = await rpc.call("ctx.persist.history", {"conversationId": cid})
    assert h["messages"][-1]["parts"] == [part] and h["persistedUris"] == [put["uri"]]
    await rpc.call("ctx.blob.release", {"owner": {"kind": "turn", "id": turn_id}})  # the turn is over
    conn = await asyncpg.connect(stack.env["CTX_DATABASE_URL"])
    try:
        refs = await conn.fetch("SELECT owner_kind, owner_id, role FROM blobstore.refs WHERE sha256 = $1 "
                                "AND conversation_id = $2", put["sha256"], cid)
    finally:
        await conn.close()
    assert [tuple(r) for r in refs] == [("message", tool_id, "tool_output")]
    page = await rpc.call("ctx.blob.fs_read", {"conversationId": cid, "uri": put["uri"], "limit": 3})
    assert page["kind"] == "text" and page["startLine"] == 1
