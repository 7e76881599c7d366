"""ctx.blob.get_result on the real stack: persisted envelopes (v1 text, v2 entities) inflated back to the original
tool output from the blob store; a gone blob degrades to its excerpt; another conversation is refused."""

import pytest
from ctxbuild_blobclient import BlobClient
from ctxbuild_codec.lanes import apply_persist, plan_persist
from ctxbuild_codec.trim import degraded_excerpt
from ctxbuild_platform.errors import RemoteError

from tests.integration import test_blobstore_security as blobstore_tests
from tests.integration.test_blobstore_security import uid

pytestmark = pytest.mark.integration
client = blobstore_tests.client  # the module's blob client (a started blob store)


async def persist(client: BlobClient, conv: str, part: dict, store: bool = True) -> tuple[dict, dict]:
    """The persist lane by hand: plan, write each blob with a tool_output reference, apply."""
    plan = plan_persist(part, 2000)
    assert plan is not None
    written = {}
    msg = uid()
    for blob in plan.blobs:
        if store:
            r = await client.put(blob.text, conv, ("message", msg), "tool_output")
            written[blob.sha256] = r["uri"]
        else:
            written[blob.sha256] = f"context://vfs/vfs_{blob.sha256[:16]}.txt"
    stored = apply_persist(part, plan, written)
    return stored["output"]["value"], {b.sha256: b for b in plan.blobs}


async def test_v1_text_envelope_inflates_to_the_original(client):
    conv = uid()
    text = "".join(f"row {i} ✓ {uid()[:6]}\n" for i in range(3000))
    part = {"type": "tool-result", "toolCallId": "c1", "toolName": "mcp__logs__tail",
            "output": {"type": "text", "value": text}}
    envelope, _ = await persist(client, conv, part)
    assert envelope["shape"] == "text"
    r = await client.get_result(conv, envelope)
    assert r == {"output": {"type": "text", "value": text}, "gone": []}


async def test_v2_entities_envelope_keeps_citations_and_inflates(client):
    conv = uid()
    items = [{"id": f"{uid()[:8]}-{i}", "title": f"T{i}", "url": f"https://e.x/{i}", "content": f"{i} " * 3000}
             for i in range(3)]
    part = {"type": "tool-result", "toolCallId": "c2", "toolName": "web_search",
            "output": {"type": "json", "value": items}}
    envelope, _ = await persist(client, conv, part)
    assert envelope["shape"] == "entities" and len(envelope["blobRefs"]) == 3
    r = await client.get_result(conv, envelope)
    assert r["output"] == {"type": "json", "value": items} and r["gone"] == []


async def test_a_gone_blob_degrades_to_its_excerpt(client):
    conv = uid()
    text = "".join(f"gone {i}\n" for i in range(2000))
    part = {"type": "tool-result", "toolCallId": "c3", "toolName": "mcp__x__y",
            "output": {"type": "text", "value": text}}
    envelope, blobs = await persist(client, conv, part, store=False)  # its blob was never stored (or collected)
    r = await client.get_result(conv, envelope)
    cut = next(iter(blobs.values()))
    assert r["gone"] == [cut.sha256]
    assert r["output"] == {"type": "text", "value": degraded_excerpt(envelope["head"], envelope["tail"])}
    assert "[persisted output no longer available — showing excerpt of" in r["output"]["value"]


async def test_another_conversation_gets_nothing(client):
    conv = uid()
    secret = "SECRET " * 1000
    part = {"type": "tool-result", "toolCallId": "c4", "toolName": "mcp__x__y",
            "output": {"type": "text", "value": secret + uid()}}
    envelope, _ = await persist(client, conv, part)
    with pytest.raises(RemoteError) as err:
        await client.get_result(uid(), envelope)
    assert err.value.code == "access-denied"
    with pytest.raises(RemoteError) as err:
        await client.get_result(conv, {"shape": "text", "fileEntryId": "nothex"})
    assert err.value.code == "invalid-payload"


async def test_a_result_too_large_for_one_reply_is_inflated_by_the_client(client, rpc):
    conv = uid()
    text = "".join(f"{i:07d} {'big' * 30}\n" for i in range(12_000))  # ~1.2 MB
    part = {"type": "tool-result", "toolCallId": "c5", "toolName": "mcp__x__y",
            "output": {"type": "text", "value": text}}
    envelope, _ = await persist(client, conv, part)
    with pytest.raises(RemoteError) as err:
        await rpc.call("ctx.blob.get_result", {"conversationId": conv, "envelope": envelope})
    assert err.value.code == "too-large" and err.value.details["blobs"][0]["size"] == len(text.encode())
    r = await client.get_result(conv, envelope)  # falls back to streaming the blobs
    assert r == {"output": {"type": "text", "value": text}, "gone": []}
