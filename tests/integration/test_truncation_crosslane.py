"""Cross-lane contract across the RUNNING services (blob store, truncation, persistence): a tool output trimmed in
flight (``ctx.truncate.step``), persisted at the end of the turn (``ctx.persist.complete_turn``) and served into
the next turn's request (``ctx.persist.history`` → the stored part, an envelope rendered with
``ctxbuild_codec.envelopes.render_part``) gives exactly the bytes the model saw in flight — for opaque text, MCP
content and web-search entities.

Two ways a turn reaches the persist lane, both checked:
- as the runner sends it: the in-flight parts (typed ``offload``) — stored as they are, the blob's reference
  promoted from the turn's provisional one to the message;
- with the outputs in full (a caller that kept the originals): the persist lane cuts them itself into v1/v2
  envelopes, which must render to the in-flight bytes and name the very blobs the in-flight markers point at.
"""

from __future__ import annotations

import hashlib
import json
import uuid

import asyncpg
import orjson
import pytest
from ctxbuild_codec import envelopes, sha256_hex, vfs_uri

from tests.support.realdata import services_fixture, start_conversation

pytestmark = pytest.mark.integration

THRESHOLD = 4_800  # configured for both lanes (no window): the in-flight and the persist thresholds agree
BIG = "".join(f"{i:05d} tool output line with some words, status=ok latency_ms={i % 97}\n" for i in range(1_200))
UNICODE = "".join(f"{i:04d} Zażółć gęślą jaźń — 東京 🚀 ¶{i}\n" for i in range(900))


services = services_fixture("blobstore", "truncation", "persistence")


def new_id() -> str:
    return uuid.uuid4().hex


def wire_bytes(value) -> bytes:
    """The bytes a request renderer produces for a value (key order kept, non-ASCII as is)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def tool_parts(tag: str) -> list[dict]:
    web = [{"id": f"{tag[:8]}-1", "title": "Long page — ünïcode", "url": "https://one.example/a?x=1&y=2",
            "content": UNICODE + tag},
           {"id": f"{tag[:8]}-2", "title": "Short", "url": "https://two.example/b", "content": "short result"},
           {"id": f"{tag[:8]}-3", "title": "Other long", "url": "https://three.example/c",
            "content": BIG[::-1] + tag, "score": 0.87, "publishedAt": None}]
    return [
        {"type": "tool-result", "toolCallId": "k-text", "toolName": "mcp__shell__run_0123456789abcdef0123",
         "output": {"type": "text", "value": BIG + tag}},
        {"type": "tool-result", "toolCallId": "k-mcp", "toolName": "mcp__docs__fetch_0123456789abcdef0123",
         "output": {"type": "content", "value": [{"type": "text", "text": UNICODE + tag},
                                                 {"type": "text", "text": "second block " + tag}]}},
        {"type": "tool-result", "toolCallId": "k-web", "toolName": "web_search",
         "output": {"type": "json", "value": web}},
    ]


async def open_conversation(rpc, user_id: str) -> str:
    return await start_conversation(rpc, f"conv-xl-{new_id()}", user_id, "research it")


def turn_messages(prefix: str, parent: str, parts: list[dict]) -> list[dict]:
    calls = [{"type": "tool-call", "toolCallId": p["toolCallId"], "toolName": p["toolName"], "input": {}}
             for p in parts]
    return [{"id": f"{prefix}-a1", "role": "assistant", "parentId": parent, "parts": calls},
            {"id": f"{prefix}-t1", "role": "tool", "parts": parts},
            {"id": f"{prefix}-a2", "role": "assistant", "parts": [{"type": "text", "text": "done"}]}]


async def trim_in_flight(rpc, cid: str, turn_id: str, parts: list[dict]) -> dict:
    return await rpc.call("ctx.truncate.step", {"conversationId": cid, "turnId": turn_id,
                                                "settings": {"truncateThreshold": THRESHOLD}, "parts": parts})


async def served_next_turn(rpc, cid: str, tool_message_id: str) -> list[dict]:
    """What the next turn's request carries for the stored tool message: each part as served (an envelope
    rendered back to the model's bytes)."""
    h = await rpc.call("ctx.persist.history", {"conversationId": cid})
    stored = next(m for m in h["messages"] if m["id"] == tool_message_id)
    return [envelopes.render_part(p) for p in stored["parts"]], h


async def test_in_flight_parts_persist_and_serve_the_same_bytes(services, rpc, stack):
    prefix = f"xl-{new_id()}"
    cid = await open_conversation(rpc, f"{prefix}-u1")
    turn_id = f"turn-{prefix}"
    raw = tool_parts(prefix)
    step = await trim_in_flight(rpc, cid, turn_id, raw)
    inflight = step["parts"]
    assert [p["output"]["type"] for p in inflight] == ["text", "text", "json"]
    assert all(p["offload"]["mode"] == "offloaded" for p in inflight)
    assert len(step["trimmed"]) == 4  # text, MCP content, two of the three entities

    res = await rpc.call("ctx.persist.complete_turn", {
        "conversationId": cid, "turnId": turn_id, "eventId": str(uuid.uuid4()),
        "messages": turn_messages(prefix, f"{prefix}-u1", inflight), "settings": {"truncateThreshold": THRESHOLD}})
    assert res["parts"] == []  # already trimmed in flight: nothing for the persist lane to cut
    # every in-flight blob: the two single-blob offloads and the two trimmed entities' blobs
    assert res["references"]["failed"] == 0 and res["references"]["promoted"] == 4

    served, h = await served_next_turn(rpc, cid, f"{prefix}-t1")
    for before, after in zip(inflight, served, strict=True):
        assert wire_bytes(after["output"]) == wire_bytes(before["output"])  # the model's bytes, turn after turn
        assert orjson.dumps(after) == orjson.dumps(before)  # provenance included
    assert {p["offload"]["uri"] for p in inflight[:2]} <= set(h["persistedUris"])

    # every offloaded blob: held by the turn's provisional reference (GC cannot race the turn), readable by
    # this conversation only, and owned by its stored message now (per-entity blobs too)
    conn = await asyncpg.connect(stack.env["CTX_DATABASE_URL"])
    try:
        for part in inflight:
            off = part["offload"]
            shas = [off["sha256"]] if "sha256" in off else [b["sha256"] for b in off["blobs"]]
            for sha in shas:
                refs = {(r["owner_kind"], r["owner_id"], r["role"]) for r in await conn.fetch(
                    "SELECT owner_kind, owner_id, role FROM blobstore.refs WHERE sha256 = $1", sha)}
                assert ("turn", turn_id, "provisional") in refs
                assert ("message", f"{prefix}-t1", "tool_output") in refs
                page = await rpc.call("ctx.blob.fs_read", {"conversationId": cid, "uri": vfs_uri(sha), "limit": 5})
                assert page["kind"] == "text", page
                denied = await rpc.call("ctx.blob.fs_read", {"conversationId": "conv-other", "uri": vfs_uri(sha)})
                assert denied["kind"] == "error" and denied["code"] == "access-denied"
    finally:
        await conn.close()


async def test_full_outputs_persisted_render_to_the_in_flight_bytes(services, rpc):
    prefix = f"xl-{new_id()}"
    cid = await open_conversation(rpc, f"{prefix}-u1")
    turn_id = f"turn-{prefix}"
    raw = tool_parts(prefix)
    inflight = (await trim_in_flight(rpc, cid, turn_id, raw))["parts"]

    res = await rpc.call("ctx.persist.complete_turn", {
        "conversationId": cid, "turnId": turn_id, "eventId": str(uuid.uuid4()),
        "messages": turn_messages(prefix, f"{prefix}-u1", raw), "settings": {"truncateThreshold": THRESHOLD}})
    assert [(p["toolCallId"], p["outcome"], p["envelope"]) for p in res["parts"]] == [
        ("k-text", "persisted", "v1"), ("k-mcp", "persisted", "v1"), ("k-web", "persisted", "v2")]

    h = await rpc.call("ctx.persist.history", {"conversationId": cid})
    stored = next(m for m in h["messages"] if m["id"] == f"{prefix}-t1")["parts"]
    assert [p["output"]["type"] for p in stored] == ["persisted"] * 3
    for before, part, original in zip(inflight, stored, raw, strict=True):
        rendered = envelopes.render(part["output"]["value"])
        assert wire_bytes(rendered) == wire_bytes(before["output"])
        served = envelopes.render_part(part)
        assert wire_bytes(served["output"]) == wire_bytes(before["output"])
        # the envelope names the very blobs the in-flight markers point at
        refs = envelopes.blob_refs(part["output"]["value"])
        inflight_shas = [before["offload"]["sha256"]] if "sha256" in before["offload"] else \
            [b["sha256"] for b in before["offload"]["blobs"]]
        assert [r["fileEntryId"] for r in refs] == inflight_shas
        # and the database holds every citation {id, url, title} unchanged
        if original["toolName"] == "web_search":
            skeleton = part["output"]["value"]["skeleton"]
            assert [(e["id"], e["url"], e["title"]) for e in skeleton] == \
                [(e["id"], e["url"], e["title"]) for e in original["output"]["value"]]
            texts = dict(zip([r["fileEntryId"] for r in refs], [UNICODE + prefix, BIG[::-1] + prefix], strict=False))
            assert [e["content"] for e in envelopes.inflate(part["output"]["value"], texts)["value"]] == \
                [e["content"] for e in original["output"]["value"]]
    # the text the model saw for the MCP output is the joined text blocks' marker, as in flight
    assert inflight[1]["offload"]["sha256"] == hashlib.sha256(
        (UNICODE + prefix + "\nsecond block " + prefix).encode()).hexdigest() == sha256_hex(
        "\n".join(b["text"] for b in raw[1]["output"]["value"]))
