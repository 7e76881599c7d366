"""The persist lane on real material: the mini-swe-agent run in ../shared/data (79 bash outputs, the full texts
from ``extra.raw_output``, up to 110,817 chars) stored as one turn through ``ctx.persist.complete_turn``.

Reports the database bytes of the stored message data against the raw tool-output bytes, at the default persist
threshold (50,000) and at the lowest one (2,000), and checks that every trimmed output comes back byte-exactly
from its blobs — through ``ctx.blob.fs_read`` paging (what the model uses) and through the streamed full read
(``ctx.blob.get`` via ctxbuild_blobclient)."""

from __future__ import annotations

import hashlib
import json
import uuid

import asyncpg
import pytest
from ctxbuild_blobclient import BlobClient
from ctxbuild_codec import envelopes
from ctxbuild_persistence.settings import Settings

from tests.support.persistence import projected, projection_history
from tests.support.realdata import REAL_DATA_SERVICES, services_fixture

pytestmark = REAL_DATA_SERVICES

TRAJECTORY = "trajectories/03_miniswe_deepseek-chat_sqlfluff-1733.traj.json"


services = services_fixture("blobstore", "persistence")




@pytest.fixture(scope="module")
def trajectory(shared_data) -> dict:
    path = shared_data / TRAJECTORY
    if not path.exists():
        pytest.skip(f"{path} absent")
    return json.loads(path.read_text())


def to_turn(traj: dict, prefix: str) -> tuple[list[dict], list[dict], list[str]]:
    """(messages before the turn, the turn's messages, the raw outputs in order) in ctxbuild's message model.
    Message ids are global (the blob store's reference owners), hence the prefix."""
    before: list[dict] = []
    turn: list[dict] = []
    raws: list[str] = []
    for i, m in enumerate(traj["messages"]):
        if m["role"] in ("system", "user"):
            before.append({"id": f"{prefix}m{i}", "role": m["role"], "parts": [{"type": "text", "text": m["content"]}]})
        elif m["role"] == "assistant":
            parts: list[dict] = [{"type": "text", "text": m["content"]}] if m.get("content") else []
            for call in m.get("tool_calls") or []:
                parts.append({"type": "tool-call", "toolCallId": call["id"], "toolName": call["function"]["name"],
                              "input": json.loads(call["function"]["arguments"])})
            msg = {"id": f"{prefix}m{i}", "role": "assistant", "parts": parts}
            usage = ((m.get("extra") or {}).get("response") or {}).get("usage")
            if usage:
                msg["usage"] = {"inputTokens": usage["prompt_tokens"], "outputTokens": usage["completion_tokens"]}
            turn.append(msg)
        elif m["role"] == "tool":
            raw = m["extra"]["raw_output"]
            raws.append(raw)
            turn.append({"id": f"{prefix}m{i}", "role": "tool", "parts": [{
                "type": "tool-result", "toolCallId": m["tool_call_id"], "toolName": "bash",
                "output": {"type": "text", "value": raw}}]})
    return before, turn, raws


async def read_by_pages(rpc, cid: str, uri: str) -> list[str]:
    lines: list[str] = []
    offset, limit = 1, 2000
    while True:
        r = await rpc.call("ctx.blob.fs_read", {"conversationId": cid, "uri": uri, "offset": offset, "limit": limit})
        if r["kind"] == "error":
            assert r["code"] == "output-too-large" and limit > 1, r
            limit = max(1, limit // 2)
            continue
        if r["endLine"] >= r["startLine"]:
            lines += [row.split("\t", 1)[1] for row in r["text"].split("\n")]
        if r["endLine"] >= r["totalLines"]:
            return lines
        offset = r["endLine"] + 1


@pytest.mark.parametrize("threshold", [None, 2000], ids=["default-50000", "lowest-2000"])
async def test_real_trajectory_through_the_persist_lane(services, rpc, stack, trajectory, threshold):
    cid = f"traj-{uuid.uuid4()}"
    before, turn, raws = to_turn(trajectory, cid[5:13])
    await rpc.call("ctx.persist.append", {"streamId": f"conversation:{cid}", "expectedVersion": 0, "events": [
        {"eventId": str(uuid.uuid4()), "type": "UserMessageAdded", "data": {"message": m}} for m in before]})
    event_id = str(uuid.uuid4())
    req = {"conversationId": cid, "turnId": "t-real", "eventId": event_id, "expectedVersion": len(before),
           "messages": turn}
    if threshold is not None:
        req["settings"] = {"truncateThreshold": threshold}
    res = await rpc.call("ctx.persist.complete_turn", req, timeout=120)
    limit = res["threshold"]
    expected = [r for r in raws if len(r) > max(limit, 1500)]
    assert len(res["parts"]) == len(expected) > 0
    assert all(p["outcome"] == "persisted" and p["envelope"] == "v1" for p in res["parts"]), res["parts"]

    h = await rpc.call("ctx.persist.history", {"conversationId": cid})
    short = h["version"] <= Settings.model_fields["history_fold_max_events"].default  # the service's setting
    assert h["source"] == ("fold" if short else "projection") and len(h["messages"]) == len(before) + len(turn)
    await projected(stack, cid, timeout=60.0)
    from_projection = await projection_history(stack, cid)  # what the service served, the projection holds too
    assert from_projection["source"] == "projection" and {**from_projection, "source": h["source"]} == h
    assert h["lastUsage"]["usage"]["inputTokens"] > 0
    stored_tools = [m for m in h["messages"] if m["role"] == "tool"]
    client = BlobClient(rpc)
    recovered = 0
    for msg, raw in zip(stored_tools, raws, strict=False):
        out = msg["parts"][0]["output"]
        if out["type"] != "persisted":
            assert out == {"type": "text", "value": raw}  # under the threshold: stored as is
            continue
        env = out["value"]
        sha = env["fileEntryId"]
        assert sha == hashlib.sha256(raw.encode()).hexdigest()
        # the streamed full read
        full = await client.get_text(cid, sha256=sha)
        # the model's way: fs_read pages (one trailing empty line is dropped: the hash decides)
        body = "\n".join(await read_by_pages(rpc, cid, "context://vfs/" + env["vfsFilename"]))
        paged = next(c for c in (body, body + "\n") if hashlib.sha256(c.encode()).hexdigest() == sha)
        assert full == paged == raw
        assert envelopes.inflate(env, {sha: full}) == {"type": "text", "value": raw}  # byte-exact read-back
        recovered += 1
    assert recovered == len(expected)
    assert set(h["persistedUris"]) == {b["uri"] for p in res["parts"] for b in p["blobs"]}

    conn = await asyncpg.connect(stack.env["CTX_DATABASE_URL"])
    try:
        ev = await conn.fetchrow("SELECT octet_length(data::text) AS text_bytes, pg_column_size(data) AS disk_bytes "
                                 "FROM persistence.events WHERE event_id = $1", uuid.UUID(event_id))
        proj = await conn.fetchrow(
            "SELECT sum(octet_length(body::text)) AS text_bytes, sum(pg_column_size(body)) AS disk_bytes "
            "FROM persistence.messages WHERE conversation_id = $1 AND position = "
            "(SELECT position FROM persistence.events WHERE event_id = $2)", cid, uuid.UUID(event_id))
    finally:
        await conn.close()
    raw_bytes = sum(len(r.encode()) for r in raws)
    unchanged = json.dumps({"turnId": "t-real", "messages": turn}, ensure_ascii=False, separators=(",", ":"))
    stored_outputs = sum(len(json.dumps(m["parts"][0]["output"], ensure_ascii=False, separators=(",", ":")).encode())
                         for m in stored_tools)
    figures = {
        "threshold": limit,
        "toolOutputs": len(raws),
        "trimmed": len(expected),
        "rawToolOutputBytes": raw_bytes,
        "trimmedRawBytes": sum(len(r.encode()) for r in expected),
        "storedToolOutputBytes": stored_outputs,
        "eventBytesIfStoredWhole": len(unchanged.encode()),
        "eventDataBytes": ev["text_bytes"],
        "eventDataBytesOnDisk": ev["disk_bytes"],
        "projectionMessageBytes": int(proj["text_bytes"]),
        "projectionMessageBytesOnDisk": int(proj["disk_bytes"]),
    }
    figures["ratioStoredToolOutputsToRaw"] = round(stored_outputs / raw_bytes, 3)
    figures["ratioEventToRaw"] = round(figures["eventDataBytes"] / raw_bytes, 3)
    figures["ratioVsWhole"] = round(figures["eventDataBytes"] / figures["eventBytesIfStoredWhole"], 3)
    print("\npersist-lane real data:", json.dumps(figures))
    assert figures["eventDataBytes"] < figures["eventBytesIfStoredWhole"]
    if limit == 2000:
        assert figures["ratioVsWhole"] < 0.5
