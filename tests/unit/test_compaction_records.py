"""Compaction reads the archived-blob provenance of a tool result through ``ctxbuild_codec.records`` (one reader
for every service): every blob a record names stays retained (SPEC §8.2, invariant 4), and a fold's transcript
holds every trimmed output read back in full through the blob store."""

from __future__ import annotations

import json

from ctxbuild_codec import trim_inflight, trim_persist, vfs_uri
from ctxbuild_compaction.adapters.blobstore import BlobStore
from ctxbuild_compaction.domain import persisted_uris

from tests.support.compaction import MemoryBlobs, trim_as_truncation
from tests.unit.test_compaction_domain import W, assistant, filler, history, long_history, run, user

T = 2_000
LONG = "".join(f"line {i}: the export row {i} failed with a timeout after three retries\n" for i in range(120))


def web_search(call_id: str = "c9") -> dict:
    """A web_search result with two long entities: the entities codec trims each one to its own blob."""
    value = [{"id": "r-1", "title": "Short", "url": "https://a.example/1", "content": "a snippet"},
             {"id": "r-2", "title": "Export", "url": "https://b.example/2", "content": LONG},
             {"id": "r-3", "title": "Retries", "url": "https://c.example/3", "content": LONG.upper()}]
    return {"type": "tool-result", "toolCallId": call_id, "toolName": "web_search",
            "output": {"type": "json", "value": value}}


def entity_exchange(store=lambda blob: blob.uri) -> tuple[list[dict], list[str]]:
    part = trim_as_truncation(web_search(), T, store)
    blobs = part["offload"].get("blobs") or []
    assert "uri" not in part["offload"] and len(blobs) == 2  # no single blob: one per trimmed entity
    rows = [assistant("a9", "Searching.", ("c9", "web_search")), {"id": "t9", "role": "tool", "parts": [part]}]
    return rows, [b["uri"] for b in blobs]


def test_trimmed_web_entities_are_in_the_retained_persisted_uris():
    rows, uris = entity_exchange()
    assert persisted_uris(rows) == uris
    served = run(history([user("u1", "Look this up."), *rows, user("u2", "And?")]))
    assert served["decision"]["status"] != "compacted"
    assert served["retained"]["persistedUris"] == uris
    # folded away, the entities stay readable: the summary row's retained context still names every blob
    folded = run(history([user("u0", "Look this up. " + filler(400)), *rows, *long_history()]), W)
    assert folded["decision"]["status"] == "compacted"
    assert set(uris) <= set(folded["retained"]["persistedUris"])


async def test_a_transcript_reads_trimmed_entities_back_in_full():
    blobs = MemoryBlobs()
    stored: dict[str, str] = {}
    rows, _ = entity_exchange(lambda blob: stored.setdefault(blob.sha256, blob.text) and blob.uri)
    for text in stored.values():
        await blobs.put(text, "conv", ("turn", "t"), "provisional")  # what truncation stored
    full = await BlobStore(blobs, 5.0).full_output(rows[1]["parts"][0], "conv")
    assert full == web_search()["output"]


async def test_a_transcript_reads_persisted_and_original_outputs_back_through_get_result():
    blobs = MemoryBlobs()

    def store(blob):
        blobs.objects[blob.sha256] = blob.text.encode()
        return blob.uri

    text = {"type": "tool-result", "toolCallId": "c1", "toolName": "bash", "output": {"type": "text", "value": LONG}}
    persisted = trim_persist(text, T, store)
    assert persisted["output"]["type"] == "persisted"
    value = json.loads(json.dumps(web_search()["output"]["value"]))
    as_json = trim_inflight({**text, "output": {"type": "json", "value": {"rows": value, "log": LONG}}}, T, store)
    assert as_json["offload"]["original"]["of"] == "value"
    rows = [{"id": "t1", "role": "tool", "parts": [persisted]}, {"id": "t2", "role": "tool", "parts": [as_json]}]
    full = await BlobStore(blobs, 5.0).full_rows(rows, "conv")
    assert full[0]["parts"][0]["output"] == text["output"]
    assert full[1]["parts"][0]["output"] == {"type": "json", "value": {"rows": value, "log": LONG}}
    assert all(vfs_uri(sha) in persisted_uris(rows) for sha in blobs.objects)
