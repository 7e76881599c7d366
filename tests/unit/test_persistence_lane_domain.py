"""Persist lane over a turn (pure part): which parts become v1/v2 envelopes, what a failed blob write keeps,
finding #3 (fs_read/read_file echoes are trimmed at persist time), and that a stored envelope renders back to
the in-flight bytes. The trimming itself is the codec library's (one implementation)."""

from __future__ import annotations

import json

from ctxbuild_codec import envelopes, persist_threshold, trim_inflight, vfs_uri
from ctxbuild_persistence.app.persist_lane import inflight_offloads
from ctxbuild_persistence.domain.persist_lane import apply_turn, blob_writes, plan_turn

BIG = "".join(f"line {i}: " + "x" * 60 + "\n" for i in range(1200))  # ~80k chars
THRESHOLD = persist_threshold(None)  # 50,000


def result(call: str, tool: str, output: dict, **extra) -> dict:
    return {"type": "tool-result", "toolCallId": call, "toolName": tool, "output": output, **extra}


def turn() -> list[dict]:
    web = [{"id": "ab12cd34-1", "title": "A", "url": "https://a.example", "content": BIG},
           {"id": "ab12cd34-2", "title": "B", "url": "https://b.example", "content": "short"}]
    return [
        {"id": "a1", "role": "assistant", "parts": [{"type": "text", "text": BIG}]},  # never trimmed: not a tool msg
        {"id": "t1", "role": "tool", "parts": [
            result("k1", "bash", {"type": "text", "value": BIG}),
            result("k2", "web_search", {"type": "json", "value": web}),
            result("k3", "fs_read", {"type": "json", "value": {"text": BIG, "startLine": 1, "endLine": 1200}}),
            result("k4", "read_file", {"type": "text", "value": BIG}),
            result("k5", "bash", {"type": "error-text", "value": BIG}),  # error outputs are left alone
            result("k6", "bash", {"type": "text", "value": "small"}),
            result("k7", "tool_invoke", {"type": "json", "value": {"text": BIG}}, effectiveToolName="read_file"),
        ]},
    ]


def all_written(plans, uri_of=vfs_uri) -> dict:
    return {(w.message_id, w.sha256): uri_of(w.sha256) for w in blob_writes(plans)}


def test_candidates_and_envelopes():
    messages = turn()
    plans = plan_turn(messages, THRESHOLD)
    assert [(p.message_id, p.part_index, p.plan.route) for p in plans] == [
        ("t1", 0, "opaque"), ("t1", 1, "codec"), ("t1", 2, "codec"), ("t1", 3, "opaque"), ("t1", 6, "codec")]
    writes = blob_writes(plans)
    assert len(writes) == 1  # the same text everywhere in one message: one blob, one reference
    stored, report = apply_turn(messages, plans, all_written(plans))
    assert stored[0] is messages[0]
    parts = stored[1]["parts"]
    assert [p["output"]["type"] for p in parts] == ["persisted"] * 4 + ["error-text", "text", "persisted"]
    assert [r["outcome"] for r in report] == ["persisted"] * 5
    assert [r["envelope"] for r in report] == ["v1", "v2", "v2", "v1", "v2"]
    assert [r["toolName"] for r in report] == ["bash", "web_search", "fs_read", "read_file", "read_file"]
    v2 = parts[1]["output"]["value"]
    # citations stay in the database: ids, titles, urls; the content is a snippet
    assert [e["id"] for e in v2["skeleton"]] == ["ab12cd34-1", "ab12cd34-2"]
    assert v2["skeleton"][0]["content"].endswith("…") and v2["skeleton"][1]["content"] == "short"
    assert [r["key"] for r in v2["blobRefs"]] == ["/0/content"]
    assert all(r["storedChars"] < 5000 and r["rawChars"] > 80_000 for r in report)
    assert messages[1]["parts"][0]["output"]["type"] == "text"  # the input is not mutated


def test_finding_3_read_tool_echoes_are_stored_trimmed():
    """fs_read is not truncatable in flight (it must not trim its own read-back), yet its codec applies at
    persist time; read_file likewise — the echo of a 80k-char file is not stored twice in full."""
    messages = [{"id": "t", "role": "tool", "parts": [
        result("k1", "fs_read", {"type": "json", "value": {"text": BIG, "totalLines": 1200}}),
        result("k2", "fs_read", {"type": "text", "value": BIG}),
        result("k3", "read_file", {"type": "json", "value": {"text": BIG}}),
    ]}]
    assert trim_inflight(messages[0]["parts"][0], 4800)["output"]["value"]["text"] == BIG  # untouched in flight
    plans = plan_turn(messages, THRESHOLD)
    stored, report = apply_turn(messages, plans, all_written(plans))
    assert [r["outcome"] for r in report] == ["persisted"] * 3
    env = stored[0]["parts"][0]["output"]["value"]
    assert env["shape"] == "entities" and [r["key"] for r in env["blobRefs"]] == ["/text"]
    assert env["skeleton"]["totalLines"] == 1200  # identity fields stay
    assert len(json.dumps(stored)) < 12_000 < 3 * len(BIG)
    # read back: the original output, exactly
    for part, original in zip(stored[0]["parts"], messages[0]["parts"], strict=True):
        assert envelopes.inflate(part["output"]["value"], {env["blobRefs"][0]["fileEntryId"]: BIG}) == \
            original["output"]


def test_a_failed_blob_write_keeps_the_full_output():
    web = [{"id": f"e-{i}", "title": "t", "url": "u", "content": BIG + str(i)} for i in range(3)]
    messages = [{"id": "t", "role": "tool", "parts": [
        result("k1", "bash", {"type": "text", "value": BIG}),
        result("k2", "web_search", {"type": "json", "value": web}),
    ]}]
    plans = plan_turn(messages, THRESHOLD)
    written = all_written(plans)
    failing = {plans[0].plan.cuts[0].sha256, plans[1].plan.cuts[1].sha256}
    written = {k: (None if k[1] in failing else v) for k, v in written.items()}
    stored, report = apply_turn(messages, plans, written)
    assert stored[0]["parts"][0] == messages[0]["parts"][0]  # whole output kept
    assert [r["outcome"] for r in report] == ["kept", "partial"]
    assert report[0]["envelope"] is None and report[0]["failedBlobs"] == 1
    env = stored[0]["parts"][1]["output"]["value"]
    assert [r["key"] for r in env["blobRefs"]] == ["/0/content", "/2/content"]
    assert env["skeleton"][1]["content"] == BIG + "1"  # the entity whose write failed keeps its full text
    # a store that acknowledged other bytes counts as failed
    stored, report = apply_turn(messages, plans, {k: vfs_uri("0" * 64) for k in written})
    assert [r["outcome"] for r in report] == ["kept", "kept"]


def test_outputs_already_offloaded_in_flight_are_left_alone():
    inflight = trim_inflight(result("k1", "bash", {"type": "text", "value": BIG}), 4800, store=lambda b: b.uri)
    assert inflight["offload"]["mode"] == "offloaded"
    messages = [{"id": "t", "role": "tool", "parts": [inflight]}]
    assert plan_turn(messages, 2000) == []
    assert inflight_offloads(messages) == [("t", inflight["offload"]["sha256"])]


def test_stored_envelope_renders_to_the_in_flight_bytes():
    part = result("k1", "bash", {"type": "text", "value": BIG})
    messages = [{"id": "t", "role": "tool", "parts": [part]}]
    plans = plan_turn(messages, 2000)
    stored, _ = apply_turn(messages, plans, all_written(plans))
    env = stored[0]["parts"][0]["output"]["value"]
    assert envelopes.render(env) == trim_inflight(part, 2000, store=lambda b: b.uri)["output"]


def test_per_entity_offloads_are_promoted_too():
    """A web result trimmed in flight has one blob per trimmed entity (offload.blobs): each needs a tool_output
    reference of the message, or releasing the turn's provisional references would strand it."""
    blobs = [{"key": f"/{i}/content", "uri": vfs_uri(c * 64), "sha256": c * 64, "totalChars": 9000, "totalLines": 1}
             for i, c in enumerate("ab")]
    part = {"type": "tool-result", "toolCallId": "c1", "toolName": "web_search",
            "output": {"type": "json", "value": []},
            "offload": {"mode": "offloaded", "totalChars": 18000, "totalLines": 2, "blobs": blobs}}
    messages = [{"id": "t", "role": "tool", "parts": [part]}, {"id": "a", "role": "assistant", "parts": [part]}]
    assert inflight_offloads(messages) == [("t", "a" * 64), ("t", "b" * 64)]
    part["offload"]["mode"] = "inline"
    assert inflight_offloads(messages) == []
