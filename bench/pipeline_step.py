"""Benchmark: one pipeline step vs the bare NATS floor, for a 50 KB tool output (measured side by side).

floor = a core-NATS request/reply round trip carrying the same 50 KB to a trivial responder.
step  = `ctx.truncate.step` (trim + offload: blob object in S3, metadata in Postgres) + `ctx.persist.append`
        of the ToolResultRecorded event (Postgres + outbox), i.e. what the turn runner does per tool result.
Both run interleaved on the same machine and stack, so the ratio is meaningful even on a noisy host.

    .venv/bin/python bench/pipeline_step.py --out bench/results/pipeline_step.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
import uuid
from pathlib import Path

import nats
from ctxbuild_devstack import Stack, private_stack
from ctxbuild_platform.rpc import RpcClient
from faststream.nats import NatsBroker
from rich.progress import Progress


def tool_output(tag: int | str, size: int = 50_000) -> str:
    """Text of exactly ``size`` chars (ASCII), distinct per ``tag``: every step really writes a new blob (no dedup
    shortcut)."""
    label = f"{tag:06d}" if isinstance(tag, int) else tag
    line = f"iteration {label} " + "lorem ipsum dolor sit amet " * 3
    return "\n".join(f"{n:05d} {line}" for n in range(size // (len(line) + 7) + 1))[:size]


def write_result(out: Path, result: dict) -> None:
    """``result`` with the machine it ran on, written to ``out`` and printed."""
    result["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                         "platform": platform.platform()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


async def measure(stack: Stack, n: int, warmup: int) -> dict:
    nc = await nats.connect(stack.env["CTX_NATS_URL"])

    async def echo(msg):
        await msg.respond(b'{"ok":true}')

    await nc.subscribe("bench.floor", cb=echo)
    broker = NatsBroker(stack.env["CTX_NATS_URL"], logger=None)
    await broker.connect()
    rpc = RpcClient(broker, default_timeout=30)
    conv, turn = f"conv_bench_{uuid.uuid4().hex[:8]}", f"turn_bench_{uuid.uuid4().hex[:8]}"
    floor, step, trunc, append = [], [], [], []
    version = 0
    with Progress() as progress:
        task = progress.add_task("50 KB: floor vs step", total=n + warmup)
        for i in range(n + warmup):
            text = tool_output(i)
            payload = text.encode()
            t0 = time.perf_counter()
            await nc.request("bench.floor", payload, timeout=10)
            t1 = time.perf_counter()
            part = {"type": "tool-result", "toolCallId": f"c{i}", "toolName": "read_file",
                    "output": {"type": "text", "value": text}}
            t2 = time.perf_counter()
            trimmed = (await rpc.call("ctx.truncate.step", {
                "conversationId": conv, "turnId": turn, "settings": {"contextWindow": 16_000}, "parts": [part]}))
            out = trimmed["parts"][0]
            t2b = time.perf_counter()
            reply = await rpc.call("ctx.persist.append", {"streamId": f"turn:{turn}", "expectedVersion": version,
                "events": [{"eventId": str(uuid.uuid4()), "type": "ToolResultRecorded", "data": {
                    "turnId": turn, "step": i + 1, "toolCallId": out["toolCallId"], "toolName": out["toolName"],
                    "output": out["output"], "trimmed": "offload" in out, "offload": out["offload"]}}]})
            t3 = time.perf_counter()
            version = reply["toVersion"]
            assert out["offload"]["mode"] == "offloaded", out["offload"]
            if i >= warmup:
                floor.append((t1 - t0) * 1000)
                step.append((t3 - t2) * 1000)
                trunc.append((t2b - t2) * 1000)
                append.append((t3 - t2b) * 1000)
            progress.advance(task)
    await broker.stop()
    await nc.drain()
    ratios = [s / f for s, f in zip(step, floor, strict=True)]
    return {
        "payload_bytes": 50_000,
        "iterations": n,
        "floor_ms": {"median": statistics.median(floor), "p99": pct(floor, 99)},
        "step_ms": {"median": statistics.median(step), "p99": pct(step, 99)},
        "step_parts_ms": {"truncate_and_blob_put": {"median": statistics.median(trunc), "p99": pct(trunc, 99)},
                          "event_append": {"median": statistics.median(append), "p99": pct(append, 99)}},
        "step_vs_floor_ratio": {"median_of_medians": statistics.median(step) / statistics.median(floor),
                                "p99_of_p99s": pct(step, 99) / pct(floor, 99),
                                "median_pairwise": statistics.median(ratios)},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench/results/pipeline_step.json"))
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()
    with private_stack("ctxbench-", services=["blobstore", "persistence", "truncation"]) as st:
        result = asyncio.run(measure(st, args.n, args.warmup))
    write_result(args.out, result)


if __name__ == "__main__":
    main()
