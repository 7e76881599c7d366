"""The handler's orchestration of plan → put → apply, with an in-memory stand-in for the blob store adapter."""

from __future__ import annotations

from ctxbuild_codec import inline_truncate, marker, sha256_hex, vfs_uri
from ctxbuild_platform import contracts
from ctxbuild_truncation.domain import PutResult
from ctxbuild_truncation.handlers import truncate_step

BIG = "".join(f"row {i}\n" for i in range(20_000))


class MemoryBlobs:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls: list[tuple[str, str, str]] = []

    async def put_provisional(self, text, conversation_id, turn_id):
        self.calls.append((sha256_hex(text), conversation_id, turn_id))
        if self.fail:
            return None
        return PutResult(vfs_uri(sha256_hex(text)), sha256_hex(text))


def payload(*outputs, **settings):
    return {"conversationId": "conv-1", "turnId": "turn-1", "settings": settings,
            "parts": [{"type": "tool-result", "toolCallId": f"c{i}", "toolName": "web_fetch", "output": o}
                      for i, o in enumerate(outputs)]}


async def test_threshold_from_settings_and_contract_valid_reply():
    req = payload({"type": "text", "value": BIG}, {"type": "text", "value": "tiny"}, contextWindow=16_000)
    contracts.validate("subjects/ctx.truncate.step.request.json", req)
    blobs = MemoryBlobs()
    reply = await truncate_step(req, blobs)
    contracts.validate("subjects/ctx.truncate.step.reply.json", reply)
    assert reply["threshold"] == 4_800
    assert reply["parts"][0]["output"]["value"] == marker(BIG)
    assert reply["parts"][1] == req["parts"][1]
    assert blobs.calls == [(sha256_hex(BIG), "conv-1", "turn-1")]


async def test_same_text_twice_is_put_once():
    blobs = MemoryBlobs()
    reply = await truncate_step(payload({"type": "text", "value": BIG}, {"type": "text", "value": BIG}), blobs)
    assert len(blobs.calls) == 1 and [t["mode"] for t in reply["trimmed"]] == ["offloaded", "offloaded"]


async def test_store_down_means_inline():
    reply = await truncate_step(payload({"type": "text", "value": BIG}), MemoryBlobs(fail=True))
    contracts.validate("subjects/ctx.truncate.step.reply.json", reply)
    assert reply["parts"][0]["output"]["value"] == inline_truncate(BIG)
    assert reply["trimmed"][0]["mode"] == "inline" and "uri" not in reply["trimmed"][0]


async def test_no_settings_uses_default_threshold():
    req = payload({"type": "text", "value": "x" * 10_000})
    del req["settings"]
    reply = await truncate_step(req, MemoryBlobs())
    assert reply["threshold"] == 50_000 and reply["trimmed"] == []


async def test_web_search_step_trims_per_entity_and_reply_is_contract_valid():
    results = [{"id": f"Xa8d0kLm-{i}", "title": f"T{i}", "url": f"https://e.example/{i}", "content": BIG[: 9000 + i]}
               for i in range(3)]
    req = {"conversationId": "conv-1", "turnId": "turn-1", "settings": {"contextWindow": 16_000},
           "parts": [{"type": "tool-result", "toolCallId": "c0", "toolName": "web_search",
                      "output": {"type": "json", "value": results}}]}
    contracts.validate("subjects/ctx.truncate.step.request.json", req)
    blobs = MemoryBlobs()
    reply = await truncate_step(req, blobs)
    contracts.validate("subjects/ctx.truncate.step.reply.json", reply)
    out = reply["parts"][0]["output"]
    assert out["type"] == "json" and [r["url"] for r in out["value"]] == [r["url"] for r in results]
    assert [r["content"] for r in out["value"]] == [marker(r["content"]) for r in results]
    assert len(blobs.calls) == 3 and [t["mode"] for t in reply["trimmed"]] == ["offloaded"] * 3
