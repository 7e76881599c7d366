"""Large inputs by claim check, against the running blob store and truncation service: a tool output too large for
one NATS message is stored first (``BlobClient.put`` → chunked upload) and named in the step's ``claims``; the
service streams it back with bounded memory, adds the turn's provisional reference and serves the codec's marker.
A CPU- or I/O-heavy request never stalls the small ones."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import Self

import asyncpg
import nats
import pytest
from ctxbuild_blobclient import BlobClient
from ctxbuild_codec import marker, sha256_hex, vfs_uri
from ctxbuild_platform.errors import RemoteError

pytestmark = pytest.mark.integration

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def services(start_service) -> None:
    start_service("blobstore")
    start_service("truncation")


def huge_text(mib: int, tag: str) -> str:
    line = f"{tag} — claimed tool output line, ünïcode and digits 0123456789 " * 2 + "\n"
    n = mib * MIB // len(line.encode()) + 1
    return line * n


def claim_request(cid: str, turn: str, sha: str, *, kind: str = "text", name: str = "mcp__shell__run_0123",
                  extra_parts: list[dict] | None = None, size: int | None = None) -> dict:
    parts = [*(extra_parts or []), {"type": "tool-result", "toolCallId": "huge", "toolName": name,
                                    "output": {"type": kind, "value": ""}}]
    claim = {"part": len(parts) - 1, "sha256": sha, "uri": vfs_uri(sha)}
    if size is not None:
        claim["size"] = size
    return {"conversationId": cid, "turnId": turn, "settings": {"contextWindow": 16_000}, "parts": parts,
            "claims": [claim]}


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


class RssSampler:
    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self.base = rss_kib(pid)
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_kib(self.pid))
            time.sleep(0.005)

    def __enter__(self) -> Self:
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


async def test_claimed_output_streams_back_with_bounded_memory(services, rpc, stack):
    cid, turn = f"conv-claim-{uuid.uuid4().hex}", f"turn-{uuid.uuid4().hex}"
    text = huge_text(40, cid)
    data_len = len(text.encode())
    blobs = BlobClient(rpc)
    stored = await blobs.put(text, cid, ("turn", f"caller-{turn}"), "provisional")  # the caller's own reference
    sha = stored["sha256"]
    assert sha == sha256_hex(text) and stored["size"] == data_len

    small = {"type": "tool-result", "toolCallId": "small", "toolName": "bash",
             "output": {"type": "text", "value": "ok"}}
    pid = stack.procs["truncation"]["pid"]
    # warm-up: first-use imports and buffers (numpy for line counts, the NATS read buffer) are not per-claim
    warm = huge_text(2, "warm-" + cid)
    warm_sha = (await blobs.put(warm, cid, ("turn", turn), "provisional"))["sha256"]
    await rpc.call("ctx.truncate.step", claim_request(cid, turn, warm_sha), timeout=60)
    with RssSampler(pid) as mem:
        reply = await rpc.call("ctx.truncate.step", claim_request(cid, turn, sha, extra_parts=[small],
                                                                  size=data_len), timeout=120)
    growth_mib = (mem.peak - mem.base) / 1024
    assert growth_mib < 16, f"the service grew by {growth_mib:.1f} MiB for a {data_len / MIB:.0f} MiB claim"
    print(f"\nclaim of {data_len / MIB:.0f} MiB: service RSS +{growth_mib:.1f} MiB at peak")

    part = reply["parts"][1]
    assert part["output"] == {"type": "text", "value": marker(text)}  # the codec's marker of the whole text
    assert part["offload"] == {"mode": "offloaded", "uri": vfs_uri(sha), "sha256": sha, "totalChars": len(text),
                               "totalLines": text.count("\n") + 1, "threshold": 4_800}
    assert reply["parts"][0] == small
    assert reply["trimmed"] == [{"toolCallId": "huge", "mode": "offloaded", "key": "", "uri": vfs_uri(sha),
                                 "sha256": sha, "claim": True, "totalChars": len(text),
                                 "totalLines": text.count("\n") + 1}]
    conn = await asyncpg.connect(stack.env["CTX_DATABASE_URL"])
    try:
        owners = {(r["owner_kind"], r["owner_id"], r["role"]) for r in await conn.fetch(
            "SELECT owner_kind, owner_id, role FROM blobstore.refs WHERE sha256 = $1", sha)}
    finally:
        await conn.close()
    assert ("turn", turn, "provisional") in owners  # the turn now holds it: GC cannot race the turn
    page = await rpc.call("ctx.blob.fs_read", {"conversationId": cid, "uri": vfs_uri(sha), "offset": 2, "limit": 1})
    assert page["kind"] == "text" and page["text"].split("\t", 1)[1] == text.split("\n", 2)[1]


async def test_claim_errors_are_typed(services, rpc):
    cid, turn = f"conv-claim-{uuid.uuid4().hex}", f"turn-{uuid.uuid4().hex}"
    with pytest.raises(RemoteError) as info:
        await rpc.call("ctx.truncate.step", claim_request(cid, turn, "0" * 64))
    assert info.value.code == "not-found" and "claim for part 0" in info.value.remote_message
    # a blob of another conversation: a hash alone never grants access
    other = f"conv-claim-{uuid.uuid4().hex}"
    text = huge_text(1, other)
    sha = (await BlobClient(rpc).put(text, other, ("turn", "t-other"), "provisional"))["sha256"]
    with pytest.raises(RemoteError) as info:
        await rpc.call("ctx.truncate.step", claim_request(cid, turn, sha))
    assert info.value.code == "access-denied"
    with pytest.raises(RemoteError) as info:  # the declared size must match the stored blob
        await rpc.call("ctx.truncate.step", claim_request(other, turn, sha, size=7))
    assert info.value.code == "invalid-payload"
    # fs_read never truncates its own read-back: a claimed fs_read output too large for a reply is refused
    with pytest.raises(RemoteError) as info:
        await rpc.call("ctx.truncate.step", claim_request(other, turn, sha, name="fs_read"))
    assert info.value.code == "too-large"


async def test_small_requests_are_answered_while_a_huge_one_is_processed(services, rpc, stack):
    """A 64 MiB claim (streamed, counted, its excerpt cut) and a ~0.9 MB web search of 400 entities each over the
    threshold (400 codec cuts and blob puts) in flight; one-part steps keep being answered meanwhile."""
    cid, turn = f"conv-busy-{uuid.uuid4().hex}", f"turn-{uuid.uuid4().hex}"
    text = huge_text(64, cid)
    sha = (await BlobClient(rpc).put(text, cid, ("turn", turn), "provisional"))["sha256"]
    del text
    entities = [{"id": f"Bz81nQ0x-{i}", "title": f"Result {i}", "url": f"https://r{i}.example/",
                 "content": f"{i:03d} " + "word " * 420} for i in range(400)]
    web = {"conversationId": cid, "turnId": turn, "settings": {"truncateThreshold": 2_000},
           "parts": [{"type": "tool-result", "toolCallId": "web", "toolName": "web_search",
                      "output": {"type": "json", "value": entities}}]}
    nc = await nats.connect(stack.env["CTX_NATS_URL"])
    try:
        async def timed(req: dict, timeout: float = 120) -> tuple[float, dict]:
            raw = json.dumps(req).encode()
            t0 = time.perf_counter()
            msg = await nc.request("ctx.truncate.step", raw, timeout=timeout)
            return time.perf_counter() - t0, json.loads(msg.data)

        heavy = [asyncio.create_task(timed(claim_request(cid, turn, sha))), asyncio.create_task(timed(web))]
        small = {"conversationId": cid, "turnId": turn, "parts": [
            {"type": "tool-result", "toolCallId": "s", "toolName": "bash", "output": {"type": "text", "value": "hi"}}]}
        latencies = []
        await asyncio.sleep(0.02)
        while not all(h.done() for h in heavy):
            dt, reply = await timed(small, timeout=5)
            assert reply["result"]["parts"][0]["output"]["value"] == "hi"
            if not all(h.done() for h in heavy):
                latencies.append(dt)
            await asyncio.sleep(0.01)
        (claim_dt, claim_reply), (web_dt, web_reply) = [h.result() for h in heavy]
    finally:
        await nc.drain()
    assert claim_reply["result"]["parts"][0]["offload"]["sha256"] == sha
    assert len(web_reply["result"]["parts"][0]["offload"]["blobs"]) == 400
    # the behaviour: small steps keep being answered while the heavy ones are still running (a blocked loop would
    # answer them only after); how fast is bench-truncation's business, not an assertion on a shared machine
    assert len(latencies) >= 3, (latencies, claim_dt, web_dt)
    print(f"\nheavy: claim {claim_dt:.2f}s, web {web_dt:.2f}s; {len(latencies)} small steps meanwhile, "
          f"median {sorted(latencies)[len(latencies) // 2] * 1000:.1f} ms, max {max(latencies) * 1000:.1f} ms")
