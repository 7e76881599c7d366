"""``ctxbuild_codec.masking.masked_part``: the one masking of an archived tool output, shared by compaction's
``masking`` summarizer and the runner's in-process window fit. Each record it reads becomes its preview-less
marker(s), naming every blob the record names; anything not archived is left alone."""

from __future__ import annotations

import base64
import json

import pytest
from ctxbuild_codec import nontext, render_marker, total_lines, trim_inflight, trim_persist
from ctxbuild_codec.masking import masked_part
from ctxbuild_codec.records import archived_uris
from ctxbuild_platform import contracts

from tests.support.compaction import trim_as_truncation

T = 2_000
LONG = "".join(f"line {i}: the export row {i} failed with a timeout after three retries\n" for i in range(120))
PNG = base64.b64encode(bytes(range(256)) * 4).decode()


def result(output, name="mcp__shell__run_0123") -> dict:
    return {"type": "tool-result", "toolCallId": "c1", "toolName": name, "output": output}


def entities() -> dict:
    return result({"type": "json", "value": [
        {"id": "r-1", "title": "Short", "url": "https://a.example/1", "content": "a snippet"},
        {"id": "r-2", "title": "Export", "url": "https://b.example/2", "content": LONG},
        {"id": "r-3", "title": "Retries", "url": "https://c.example/3", "content": LONG.upper()}]}, "web_search")


def image() -> dict:
    return result({"type": "content", "value": [{"type": "text", "text": LONG},
                                                {"type": "image", "data": PNG, "mimeType": "image/png"}]})


def store(blob):
    return blob.uri


def shown(part) -> str:
    return json.dumps(part["output"], ensure_ascii=False)


def check(part, masked) -> None:
    """Smaller than what was served, every blob the record names still named, the record kept, idempotent."""
    contracts.validate("model/part.json", masked)
    assert len(shown(masked)) < len(shown(part))
    assert all(uri in shown(masked) for uri in archived_uris([{"parts": [part]}]))
    assert masked.get("offload") == part.get("offload") or part["output"]["type"] == "persisted"
    assert masked_part(masked) is None


@pytest.mark.parametrize("kind", ["text", "error-text"])
def test_a_single_blob_offload_becomes_its_marker_and_keeps_its_type(kind):
    part = trim_inflight(result({"type": kind, "value": LONG}), T, store)
    masked = masked_part(part)
    assert masked["output"] == {"type": kind, "value": render_marker("", "", total_lines(LONG), len(LONG),
                                                                     part["offload"]["uri"])}
    check(part, masked)


def test_a_non_text_original_keeps_its_markers_and_their_blob():
    part = trim_inflight(image(), T, store)
    original = part["offload"]["original"]
    masked = masked_part(part)
    assert masked["output"]["type"] == "text" and "image not shown" in masked["output"]["value"]
    assert masked["output"]["value"] == nontext.render_with_markers(
        render_marker("", "", part["offload"]["totalLines"], part["offload"]["totalChars"], part["offload"]["uri"]),
        original["parts"], original["uri"])
    check(part, masked)


def test_a_json_value_offloaded_whole_becomes_a_text_marker():
    part = trim_inflight(result({"type": "json", "value": {"log": LONG}}), T, store)
    assert part["offload"]["original"]["of"] == "value"
    check(part, masked_part(part))


def test_trimmed_entities_keep_their_json_with_one_preview_less_marker_each():
    part = trim_as_truncation(entities(), T, store)
    masked = masked_part(part)
    assert masked["output"]["type"] == "json"
    value = masked["output"]["value"]
    assert [e["url"] for e in value] == [e["url"] for e in entities()["output"]["value"]]  # the citations stay
    assert value[0]["content"] == "a snippet"
    for entity, blob in zip(value[1:], part["offload"]["blobs"], strict=True):
        assert entity["content"] == render_marker("", "", blob["totalLines"], blob["totalChars"], blob["uri"])
    check(part, masked)


@pytest.mark.parametrize("make", [lambda: result({"type": "text", "value": LONG}), entities, image],
                         ids=["v1", "v2-entities", "v1-original"])
def test_a_persisted_envelope_is_rendered_without_previews(make):
    part = trim_persist(make(), T, store)
    assert part["output"]["type"] == "persisted"
    masked = masked_part(part)
    assert "preview omitted" in shown(masked) and LONG[:200] not in shown(masked)
    check(part, masked)


def test_what_is_not_archived_is_left_alone():
    plain = result({"type": "text", "value": LONG})
    inline = trim_inflight(plain, T)  # no blob store: truncated inline, nothing to read back
    assert inline["offload"]["mode"] == "inline"
    small_text_big_image = trim_inflight(result({"type": "content", "value": [
        {"type": "text", "text": "here"}, {"type": "image", "data": base64.b64encode(bytes(30_000)).decode(),
                                           "mimeType": "image/png"}]}), T, store)
    assert "uri" not in small_text_big_image["offload"]  # only the original was written: its text is whole
    broken = result({"type": "persisted", "value": {"not": "an envelope"}})
    entities_unwritten = trim_as_truncation(entities(), T, lambda blob: None)
    for part in (plain, inline, small_text_big_image, broken, entities_unwritten):
        assert masked_part(part) is None
