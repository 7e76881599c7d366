"""Benchmark: the truncation service (``ctx.truncate.step``) vs its floor, side by side in one run.

For a 50 KB and a 1 MB tool output (numbered text lines, distinct per iteration: no dedup shortcut):
- step  = one ``ctx.truncate.step`` round trip from a caller (pre-encoded request bytes, reply decoded): the
          service decodes and validates, cuts with the codec, puts the full text into the blob store with a
          provisional reference (50 KB: inline ``ctx.blob.put``; 1 MB: the chunked ``ctx.blob.upload`` — both via
          ``ctxbuild_blobclient.BlobClient``) and replies with the marker;
- floor = a bare core-NATS request/reply carrying the same bytes to a trivial responder, plus one blob put of the
          same number of bytes through the blob store service on the same transfer path (``BlobClient.put``:
          inline for 50 KB, chunked upload for 1 MB).
Interleaved (the order alternates every iteration). ``step_ratio_vs_floor``: median(step)/median(floor) and
p99(step)/p99(floor), plus the per-iteration ratios' median and p99.

Throughput: 16 concurrent callers send steps (distinct texts) for a fixed number of requests, with 1 and then 2
replicas of the truncation service in its queue group (the second is started here with the stack's env and its
own CTX_HTTP_PORT); MB/s = tool-output bytes / wall time. Reported next to it, under the same concurrency: the
floor's throughput (NATS + blob put: what the blob store alone sustains) and the service's own capacity without
blob I/O (the same bytes as fs_read echoes, which are never cut in flight).

The stack is private (a temporary directory): NATS, Postgres, SeaweedFS, the blob store and the truncation
service.

    .venv/bin/python bench/truncation.py --out bench/results/truncation.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Self

import httpx
import nats
from ctxbuild_blobclient import BlobClient
from ctxbuild_devstack import Stack, free_port, private_stack
from ctxbuild_platform.rpc import RpcClient
from faststream.nats import NatsBroker
from pipeline_step import tool_output, write_result  # a sibling bench (run from bench/)

TARGET_RATIO = 1.5
SIZES = {"50KB": 50_000, "1MB": 1_000_000}


def step_request(conv: str, turn: str, call: str, text: str, tool: str = "mcp__shell__run_0123") -> bytes:
    return json.dumps({"conversationId": conv, "turnId": turn, "settings": {"contextWindow": 16_000},
                       "parts": [{"type": "tool-result", "toolCallId": call, "toolName": tool,
                                  "output": {"type": "text", "value": text}}]},
                      ensure_ascii=False, separators=(",", ":")).encode()


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def summary(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 3), "p99": round(pct(xs, 99), 3),
            "mean": round(statistics.fmean(xs), 3)}


class Bench:
    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.run_id = uuid.uuid4().hex[:8]

    async def __aenter__(self) -> Self:
        url = self.stack.env["CTX_NATS_URL"]
        self.nc = await nats.connect(url, name="bench-truncation")

        async def ack(msg):
            await msg.respond(b'{"ok":true}')

        await self.nc.subscribe("bench.floor", cb=ack)
        self.broker = NatsBroker(url, logger=None)
        await self.broker.connect()
        self.blobs = BlobClient(RpcClient(self.broker, 60.0))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.broker.stop()
        await self.nc.drain()

    async def floor(self, conv: str, turn: str, text: str, payload: bytes) -> float:
        t0 = time.perf_counter()
        await self.nc.request("bench.floor", payload, timeout=30)
        reply = await self.blobs.put(text, conv, ("turn", turn), "provisional", media_type="text/plain")
        dt = time.perf_counter() - t0
        assert reply["sha256"]
        return dt

    async def step(self, payload: bytes) -> float:
        t0 = time.perf_counter()
        msg = await self.nc.request("ctx.truncate.step", payload, timeout=60)
        reply = json.loads(msg.data)
        dt = time.perf_counter() - t0
        assert "result" in reply, reply
        assert reply["result"]["parts"][0]["offload"]["mode"] == "offloaded", reply["result"]["trimmed"]
        return dt

    async def latency(self, label: str, size: int, n: int, warmup: int) -> dict:
        conv, turn = f"conv_bt_{self.run_id}_{label}", f"turn_bt_{self.run_id}_{label}"
        floor, step, ratios = [], [], []
        for i in range(n + warmup):
            f_text = tool_output(f"{self.run_id}-{label}-f{i}", size)
            s_text = tool_output(f"{self.run_id}-{label}-s{i}", size)
            s_payload = step_request(conv, turn, f"c{i}", s_text)
            f_payload = step_request(conv, turn, f"c{i}", f_text)  # the same bytes on the wire
            if i % 2:
                s = await self.step(s_payload)
                f = await self.floor(conv, turn, f_text, f_payload)
            else:
                f = await self.floor(conv, turn, f_text, f_payload)
                s = await self.step(s_payload)
            if i >= warmup:
                floor.append(f * 1000)
                step.append(s * 1000)
                ratios.append(s / f)
        return {
            "tool_output_bytes": size,
            "request_bytes": len(s_payload),
            "iterations": n,
            "floor_ms": summary(floor),
            "step_ms": summary(step),
            "step_ratio_vs_floor": {
                "median": round(statistics.median(step) / statistics.median(floor), 3),
                "p99": round(pct(step, 99) / pct(floor, 99), 3),
                "pairwise_median": round(statistics.median(ratios), 3),
                "pairwise_p99": round(pct(ratios, 99), 3),
            },
            "target_median_ratio": TARGET_RATIO,
        }

    async def throughput(self, label: str, size: int, requests: int, callers: int = 16) -> dict:
        """MB/s of tool output through the service under ``callers`` concurrent callers, next to the floor's
        (NATS + blob put: what the blob store alone sustains, measured right after) and the service's own capacity
        without blob I/O (the same bytes as an fs_read echo, which is never cut in flight: parse, check, plan,
        reply)."""
        conv, turn = f"conv_tp_{self.run_id}_{label}", f"turn_tp_{self.run_id}_{label}"
        texts = [tool_output(f"{self.run_id}-{label}-tp{uuid.uuid4().hex[:6]}-{i}", size) for i in range(requests)]
        payloads = [step_request(conv, turn, f"c{i}", t) for i, t in enumerate(texts)]
        echoes = [step_request(conv, turn, f"e{i}", t, tool="fs_read") for i, t in enumerate(texts)]

        async def run(kind: str) -> float:
            queue = list(range(requests))

            async def caller():
                while queue:
                    i = queue.pop()
                    if kind == "step":
                        await self.step(payloads[i])
                    elif kind == "service_only":
                        msg = await self.nc.request("ctx.truncate.step", echoes[i], timeout=60)
                        assert b'"result"' in msg.data[:20]
                    else:
                        await self.floor(conv, turn, texts[i] + "~", payloads[i])

            t0 = time.perf_counter()
            await asyncio.gather(*(caller() for _ in range(callers)))
            return time.perf_counter() - t0

        step_s = await run("step")
        floor_s = await run("floor")
        own_s = await run("service_only")
        mb = size * requests / 1e6
        return {"requests": requests, "callers": callers, "step_mb_s": round(mb / step_s, 1),
                "step_requests_s": round(requests / step_s, 1), "floor_mb_s": round(mb / floor_s, 1),
                "step_vs_floor_throughput": round(floor_s / step_s, 3),
                "service_only_mb_s": round(mb / own_s, 1)}


def start_replica(stack: Stack) -> subprocess.Popen:
    """A second truncation process in the same queue group (the stack's env, its own HTTP port)."""
    port = free_port()
    env = {**os.environ, **stack.service_env("truncation"), "CTX_HTTP_PORT": str(port)}
    log = open(stack.logs / "truncation-2.log", "ab")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen([sys.executable, "-m", "ctxbuild_truncation"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("second truncation replica did not become ready")


async def measure(stack: Stack, n: int, warmup: int, tp_requests: dict[str, int]) -> dict:
    out: dict = {"latency": {}, "throughput": {}}
    async with Bench(stack) as b:
        for label, size in SIZES.items():
            print(f"latency {label} …", flush=True)
            out["latency"][label] = await b.latency(label, size, n if size < 500_000 else max(20, n // 2), warmup)
        for label, size in SIZES.items():
            print(f"throughput {label}, 1 replica …", flush=True)
            out["throughput"].setdefault(label, {})["replicas_1"] = await b.throughput(label, size,
                                                                                      tp_requests[label])
    replica = start_replica(stack)
    try:
        async with Bench(stack) as b:
            for label, size in SIZES.items():
                print(f"throughput {label}, 2 replicas …", flush=True)
                out["throughput"][label]["replicas_2"] = await b.throughput(label, size, tp_requests[label])
    finally:
        replica.terminate()
        try:
            replica.wait(timeout=20)
        except subprocess.TimeoutExpired:
            replica.kill()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench/results/truncation.json"))
    ap.add_argument("-n", type=int, default=200, help="latency iterations per size (1 MB: half)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--tp-50kb", type=int, default=1600, help="requests per throughput run, 50 KB")
    ap.add_argument("--tp-1mb", type=int, default=160, help="requests per throughput run, 1 MB")
    args = ap.parse_args()
    with private_stack("ctxbench-trunc-", services=["blobstore", "truncation"]) as st:
        result = asyncio.run(measure(st, args.n, args.warmup, {"50KB": args.tp_50kb, "1MB": args.tp_1mb}))
    result["ratio_holds"] = all(v["step_ratio_vs_floor"]["median"] <= TARGET_RATIO
                                for v in result["latency"].values())
    write_result(args.out, result)


if __name__ == "__main__":
    main()
