"""The handler: plan → put / claim read-back → apply, with in-memory stand-ins for the blob store adapter; the wire
handler's typed errors; CPU work on threads for large requests; timeouts fall back to inline."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from ctxbuild_codec import inline_truncate, marker, sha256_hex, vfs_uri
from ctxbuild_platform import contracts
from ctxbuild_platform.errors import RemoteError
from ctxbuild_truncation.adapters.blobstore import BlobStore
from ctxbuild_truncation.app import truncate_step
from ctxbuild_truncation.domain import PutResult
from ctxbuild_truncation.handlers import StepHandler

BIG = "".join(f"row {i}\n" for i in range(20_000))


class MemoryBlobs:
    """The adapter's interface, in memory: puts, the turn's provisional references, claimed texts."""

    def __init__(self, fail: bool = False, fail_sha: set[str] | None = None) -> None:
        self.fail = fail
        self.fail_sha = fail_sha or set()
        self.calls: list[tuple[str, str, str]] = []
        self.stored: dict[str, bytes] = {}
        self.refs: list[tuple[str, str, str]] = []
        self.chunk = 1000

    async def put_provisional(self, text, sha256, conversation_id, turn_id):
        assert sha256 == sha256_hex(text)
        self.calls.append((sha256, conversation_id, turn_id))
        if self.fail or sha256 in self.fail_sha:
            return None
        self.stored[sha256] = text.encode()
        return PutResult(vfs_uri(sha256), sha256)

    def store(self, text: str) -> str:
        sha = sha256_hex(text)
        self.stored[sha] = text.encode()
        return sha

    async def ref_provisional(self, sha256, conversation_id, turn_id):
        if sha256 not in self.stored:
            raise RemoteError("ctx.blob.ref", "not-found", f"no blob {sha256}", False)
        self.refs.append((sha256, conversation_id, turn_id))
        return {"sha256": sha256}

    async def stream(self, sha256, conversation_id):
        if sha256 not in self.stored:
            raise RemoteError("ctx.blob.get", "not-found", f"no blob {sha256}", False)
        data = self.stored[sha256]
        for i in range(0, len(data), self.chunk):
            await asyncio.sleep(0)
            yield data[i:i + self.chunk]


def payload(*outputs, name="web_fetch", **settings):
    return {"conversationId": "conv-1", "turnId": "turn-1", "settings": settings,
            "parts": [{"type": "tool-result", "toolCallId": f"c{i}", "toolName": name, "output": o}
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
    blobs = MemoryBlobs(fail_sha={sha256_hex(BIG[:9001])})
    reply = await truncate_step(req, blobs)
    contracts.validate("subjects/ctx.truncate.step.reply.json", reply)
    out = reply["parts"][0]["output"]
    assert out["type"] == "json" and [r["url"] for r in out["value"]] == [r["url"] for r in results]
    assert [r["content"] for r in out["value"]] == [marker(results[0]["content"]), results[1]["content"],
                                                    marker(results[2]["content"])]
    assert len(blobs.calls) == 3 and [t["key"] for t in reply["trimmed"]] == ["/0/content", "/2/content"]
    assert [b["uri"] for b in reply["parts"][0]["offload"]["blobs"]] == [
        vfs_uri(sha256_hex(results[0]["content"])), vfs_uri(sha256_hex(results[2]["content"]))]


# ---------- claim check ----------

def claimed(text_sha, kind="text", name="mcp__shell__run_0123", **settings):
    return {"conversationId": "conv-1", "turnId": "turn-1", "settings": settings,
            "parts": [{"type": "tool-result", "toolCallId": "small", "toolName": name,
                       "output": {"type": "text", "value": BIG}},
                      {"type": "tool-result", "toolCallId": "huge", "toolName": name,
                       "output": {"type": kind, "value": ""}}],
            "claims": [{"part": 1, "sha256": text_sha}]}


async def test_claimed_output_is_served_as_its_marker_with_the_turns_reference():
    blobs = MemoryBlobs()
    huge = "".join(f"{i:07d} é claimed\n" for i in range(30_000))
    sha = blobs.store(huge)
    req = claimed(sha, kind="error-text", contextWindow=16_000)
    contracts.validate("subjects/ctx.truncate.step.request.json", req)
    reply = await truncate_step(req, blobs)
    contracts.validate("subjects/ctx.truncate.step.reply.json", reply)
    part = reply["parts"][1]
    assert part["output"] == {"type": "error-text", "value": marker(huge)}
    assert part["offload"] == {"mode": "offloaded", "uri": vfs_uri(sha), "sha256": sha, "totalChars": len(huge),
                               "totalLines": 30_001, "threshold": 4_800}
    assert reply["parts"][0]["output"]["value"] == marker(BIG)
    assert blobs.refs == [(sha, "conv-1", "turn-1")]
    assert [c[0] for c in blobs.calls] == [sha256_hex(BIG)]  # the claimed text is not put again
    assert reply["trimmed"][1] == {"toolCallId": "huge", "mode": "offloaded", "key": "", "uri": vfs_uri(sha),
                                   "sha256": sha, "claim": True, "totalChars": len(huge), "totalLines": 30_001}


async def test_claimed_output_needing_no_trim_comes_back_whole_or_too_large():
    blobs = MemoryBlobs()
    text = "z" * 5_000
    sha = blobs.store(text)
    reply = await truncate_step(claimed(sha, name="fs_read"), blobs)  # fs_read: never truncated in flight
    assert reply["parts"][1]["output"] == {"type": "text", "value": text} and "offload" not in reply["parts"][1]
    from ctxbuild_truncation.app import Limits, TooLarge
    with pytest.raises(TooLarge):
        await truncate_step(claimed(sha, name="fs_read"), blobs, limits=Limits(claim_inline_max_bytes=4_000))


async def test_unknown_claim_is_a_typed_error():
    with pytest.raises(Exception) as info:
        await truncate_step(claimed("00" * 32), MemoryBlobs())
    assert getattr(info.value, "code", None) == "not-found" and "claim for part 1" in str(info.value)


# ---------- the wire handler ----------

async def test_wire_errors_are_typed():
    with ThreadPoolExecutor(1) as pool:
        h = StepHandler(MemoryBlobs(), pool)
        assert json.loads(await h.handle(b"{nope"))["error"]["code"] == "invalid-payload"
        assert json.loads(await h.handle(b'{"parts": []}'))["error"]["code"] == "invalid-payload"
        big_bad = json.dumps({"conversationId": "c", "turnId": "t", "parts": [], "x": "y" * 100_000}).encode()
        assert json.loads(await h.handle(big_bad))["error"]["code"] == "invalid-payload"
        r = json.loads(await h.handle(json.dumps(claimed("00" * 32)).encode()))
        assert r["error"]["code"] == "not-found"


class CountingPool(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(2)
        self.jobs: list[str] = []

    def submit(self, fn, *args, **kwargs):
        self.jobs.append(fn.args[0].__name__)  # partial(context.run, job, …): the job runs in the caller's context
        return super().submit(fn, *args, **kwargs)


async def test_small_requests_stay_on_the_loop_large_ones_go_to_threads():
    with CountingPool() as pool:
        h = StepHandler(MemoryBlobs(), pool, loop_max_bytes=32 * 1024, loop_max_parts=8)
        small = await h.handle(json.dumps(payload({"type": "text", "value": "hi"})).encode())
        assert "result" in json.loads(small) and pool.jobs == []
        large = await h.handle(json.dumps(payload({"type": "text", "value": BIG})).encode())
        reply = json.loads(large)["result"]
        assert reply["parts"][0]["output"]["value"] == marker(BIG)
        assert pool.jobs == ["decode", "prepare", "finish_wire"]
        many = await h.handle(json.dumps(payload(*[{"type": "text", "value": "x"}] * 9)).encode())
        assert "result" in json.loads(many) and pool.jobs[3:] == ["check", "prepare", "finish_wire"]


async def test_a_cpu_heavy_request_does_not_stall_a_small_one():
    """100,000 parts (CPU-heavy decode, plan, apply and encode) vs a one-part request sent just after it."""
    heavy = json.dumps(payload(*[{"type": "text", "value": f"r{i}"} for i in range(100_000)])).encode()
    small = json.dumps(payload({"type": "text", "value": "hello"})).encode()
    with ThreadPoolExecutor(2) as pool:
        h = StepHandler(MemoryBlobs(), pool)
        done: dict[str, float] = {}

        async def timed(name, raw):
            out = json.loads(await h.handle(raw))
            done[name] = time.perf_counter()
            return out

        heavy_task = asyncio.create_task(timed("heavy", heavy))
        await asyncio.sleep(0.05)  # the heavy one is being validated on a CPU thread
        assert not heavy_task.done()
        s = await timed("small", small)
        h_reply = await heavy_task
    assert "result" in s and "result" in h_reply and len(h_reply["result"]["parts"]) == 100_000
    # not stalled behind it: the small request is answered while the heavy one is still being processed
    # (an ordering, not a timing bound — this machine is shared and noisy)
    assert done["small"] < done["heavy"]


# ---------- the adapter's timeout ----------

class SlowClient:
    def __init__(self, delay: float) -> None:
        self.delay = delay

    async def put(self, text, conversation_id, owner, role, **kw):
        await asyncio.sleep(self.delay)
        return {"uri": vfs_uri(sha256_hex(text)), "sha256": sha256_hex(text)}


async def test_a_slow_blob_put_times_out_into_the_inline_fallback():
    store = BlobStore(SlowClient(5.0), timeout_s=0.05, timeout_per_mib_s=0.0)  # type: ignore[arg-type]
    reply = await truncate_step(payload({"type": "text", "value": BIG}), store)
    # the put timed out into the inline fallback (had it waited the 5 s out, the text would be offloaded)
    assert reply["parts"][0]["output"]["value"] == inline_truncate(BIG)
    assert reply["parts"][0]["offload"]["mode"] == "inline"
    quick = BlobStore(SlowClient(0.0), timeout_s=1.0)  # type: ignore[arg-type]
    reply = await truncate_step(payload({"type": "text", "value": BIG}), quick)
    assert reply["parts"][0]["offload"]["mode"] == "offloaded"
