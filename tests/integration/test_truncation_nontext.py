"""SPEC §15.1 through the real truncation and blob store services: an MCP output with an image, text and
structuredContent is trimmed in flight, its original output is kept whole in the blob store and read back
byte-identical (ctx.blob.get_result with the offload record; fs_read of the original's URI); a persisted
envelope naming an original inflates the same way; a JSON output names its value blob as its original."""

from __future__ import annotations

import base64
import hashlib
import json
import uuid

import pytest
from ctxbuild_blobclient import BlobClient
from ctxbuild_codec import compact_json, marker, nontext, sha256_hex, vfs_uri
from ctxbuild_codec.lanes import apply_persist, plan_persist

pytestmark = pytest.mark.integration

TEXT = "\n".join(f"{i:05d} listing row with some words in it" for i in range(1, 601))  # ~22 KB
IMAGE = hashlib.sha256(b"seed").digest() * 900                                          # 28,800 bytes
SETTINGS = {"truncateThreshold": 100_000, "contextWindow": 16_000, "reservation": None}  # threshold 4,800


@pytest.fixture(scope="module")
def client(start_service, rpc) -> BlobClient:
    start_service("blobstore")
    start_service("truncation")
    return BlobClient(rpc)


def ids() -> tuple[str, str]:
    return f"conv-{uuid.uuid4()}", f"turn-{uuid.uuid4()}"


def mcp_output() -> dict:
    return {"type": "content",
            "value": [{"type": "text", "text": TEXT},
                      {"type": "image", "data": base64.b64encode(IMAGE).decode(), "mimeType": "image/png"},
                      {"type": "resource_link", "uri": "file:///srv/report.csv", "name": "report.csv"}],
            "metadata": {"structuredContent": {"rows": 600, "columns": ["n", "text"], "big": 2**80}}}


def step(conversation_id: str, turn_id: str, output: dict, name: str = "mcp__files__list_0123") -> dict:
    return {"conversationId": conversation_id, "turnId": turn_id, "settings": SETTINGS,
            "parts": [{"type": "tool-result", "toolCallId": "call-1", "toolName": name, "output": output}]}


async def test_image_text_and_structured_content_trimmed_and_read_back_byte_identical(client, rpc):
    conv, turn = ids()
    output = mcp_output()
    reply = await rpc.call("ctx.truncate.step", step(conv, turn, output))
    part = reply["parts"][0]
    original = nontext.original_text(output)
    osha = sha256_hex(original)

    # the model sees the text's marker, then one marker per non-text part naming the original's URI
    value = part["output"]["value"]
    assert part["output"]["type"] == "text" and value.startswith(marker(TEXT))
    assert "image not shown (content block 2 of 3, image/png, 28800 bytes)" in value
    assert 'resource_link not shown (content block 3 of 3, name "report.csv"' in value
    assert "structuredContent not shown" in value and value.count(vfs_uri(osha)) == 3
    assert part["offload"]["original"]["sha256"] == osha and part["offload"]["sha256"] == sha256_hex(TEXT)
    assert [(t["key"], t.get("original", False)) for t in reply["trimmed"]] == [("", False), ("#original", True)]

    # UI read-back: the original output, byte-identical (image bytes included)
    back = await client.get_result(conv, offload=part["offload"])
    assert back["gone"] == [] and compact_json(back["output"]) == compact_json(output) and back["output"] == output
    assert base64.b64decode(back["output"]["value"][1]["data"]) == IMAGE
    assert back["output"]["metadata"]["structuredContent"]["big"] == 2**80
    # the blob is the output's JSON, one value per line, so the model can page it with fs_read
    assert await client.get_bytes(conv, sha256=osha) == original.encode()
    page = await rpc.call("ctx.blob.fs_read", {"conversationId": conv, "uri": vfs_uri(osha), "limit": 8})
    assert page["kind"] == "text" and page["text"].startswith(f"{1:6d}\t{{\n{2:6d}\t \"type\": \"content\",")
    tail = await rpc.call("ctx.blob.fs_read", {"conversationId": conv, "uri": vfs_uri(osha),
                                               "offset": page["totalLines"] - 8})
    assert '"big": 1208925819614629174706176' in tail["text"]
    text_page = await rpc.call("ctx.blob.fs_read", {"conversationId": conv, "uri": part["offload"]["uri"],
                                                    "limit": 3})
    assert text_page["text"].startswith(f"{1:6d}\t00001 listing row")

    # another conversation cannot read it back
    other, _ = ids()
    with pytest.raises(Exception) as exc:
        await client.get_result(other, offload=part["offload"])
    assert getattr(exc.value, "code", None) in ("access-denied", "not-found")


async def test_small_image_output_is_served_as_it_came(client, rpc):
    conv, turn = ids()
    output = {"type": "content", "value": [{"type": "text", "text": "the chart"},
                                           {"type": "image", "data": "iVBORw0KGgo=", "mimeType": "image/png"}]}
    reply = await rpc.call("ctx.truncate.step", step(conv, turn, output))
    assert reply["parts"][0]["output"] == output and "offload" not in reply["parts"][0]
    assert reply["trimmed"] == []


async def test_persisted_envelope_with_an_original_inflates_byte_identical(client):
    conv = f"conv-{uuid.uuid4()}"
    output = mcp_output()
    part = {"type": "tool-result", "toolCallId": "c1", "toolName": "mcp__files__list_0123", "output": output}
    plan = plan_persist(part, 2_000)
    msg = f"msg-{uuid.uuid4()}"
    written = {}
    for blob in plan.blobs:  # the persist lane by hand: each blob with a tool_output reference of the message
        written[blob.sha256] = (await client.put(blob.text, conv, ("message", msg), "tool_output"))["uri"]
    envelope = apply_persist(part, plan, written)["output"]["value"]
    assert envelope["original"]["fileEntryId"] == sha256_hex(nontext.original_text(output))
    back = await client.get_result(conv, envelope)
    assert back["gone"] == [] and compact_json(back["output"]) == compact_json(output)


async def test_json_output_names_its_value_blob_and_reads_back(client, rpc):
    conv, turn = ids()
    value = {"items": [{"id": i, "title": f"item {i}", "score": i / 7, "n": 10**20 + i} for i in range(10_000)]}
    text = compact_json(value)
    assert 700_000 < len(text.encode()) < 1_000_000  # one NATS message; larger ones take the platform claim check
    reply = await rpc.call("ctx.truncate.step", step(conv, turn, {"type": "json", "value": value}), timeout=60)
    part = reply["parts"][0]
    assert part["output"] == {"type": "text", "value": marker(text)}
    assert part["offload"]["original"] == {"uri": vfs_uri(sha256_hex(text)), "sha256": sha256_hex(text),
                                           "totalChars": len(text), "of": "value", "type": "json"}
    # over get_result's one-reply budget: the client streams the blob and parses it the same way
    back = await client.get_result(conv, offload=part["offload"])
    assert back["output"] == {"type": "json", "value": value}
    assert compact_json(back["output"]["value"]) == text
    assert json.loads(await client.get_text(conv, sha256=sha256_hex(text))) == value


def test_markers_are_the_codec_s():
    """The service adds nothing of its own: the markers above are ctxbuild_codec.nontext's."""
    output = mcp_output()
    shown = nontext.render_markers(nontext.describe(output), "context://vfs/vfs_0000000000000000.txt")
    assert len(shown) == 3 and all(m.startswith("<persisted-output>\n") for m in shown)
