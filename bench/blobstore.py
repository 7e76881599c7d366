"""Benchmark: the blob store vs the raw S3 client on the same S3 server, side by side in one run.

- put+get of 1 MiB text blobs: ``BlobClient.put`` (chunked upload over NATS — 1 MiB does not fit one message —
  S3 write, metadata + reference in Postgres) and ``BlobClient.get_bytes`` (access check in Postgres, S3 read,
  chunks pushed over NATS, sha256 verified by the client) vs ``minio.put_object`` / ``get_object`` of the same
  bytes. Interleaved (the order alternates every iteration), distinct content per iteration (no dedup
  shortcut), reads of blobs never read before (no warm cache). Ratio = median(service) / median(raw).
- fs_read of a 2,000-line page at random offsets of a 100 MB blob (17-byte lines, so a full page fits the
  default 50,000-char cap): median and p99.
- Context, ``claim_check_floor``: the same put/get (interleaved with the raw client, its own samples) through a
  bare nats-py responder that does only the transport — pull + hash + PUT; GET + push in two messages +
  the caller's sha256 check — with no framework, Postgres, contracts or index: the lowest ratio a claim-check
  service can reach on this machine, against which the service's own ratios read.

The stack is private (a temporary directory), durable settings (Postgres fsync on), one blob-store process.

    .venv/bin/python bench/blobstore.py --out bench/results/blobstore.json
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from ctxbuild_blobclient import BlobClient
from ctxbuild_devstack import Stack, private_stack
from ctxbuild_platform.rpc import RpcClient
from faststream.nats import NatsBroker
from minio import Minio

MIB = 1024 * 1024
TARGET_RATIO = 1.5


def blob_text(i: int, size: int = MIB) -> str:
    """Distinct, realistic text (log-like lines) of exactly ``size`` bytes."""
    rnd = random.Random(i)
    words = ["alpha", "beta", "gamma", "delta", "tool", "output", "status=ok", "latency_ms=12", "GET", "/api/v1"]
    out, n = [], 0
    while n < size:
        line = f"{i:06d}-{len(out):06d} " + " ".join(rnd.choice(words) for _ in range(8)) + "\n"
        out.append(line)
        n += len(line)
    return "".join(out)[:size]


def page_text_chunks(total: int, chunk_lines: int = 200_000):
    """~100 MB of 17-byte lines, generated in chunks (never the whole text in memory)."""
    n, written = 0, 0
    while written < total:
        piece = "".join(f"{i:09d} abcdef\n" for i in range(n, n + chunk_lines))
        if written + len(piece) > total:
            piece = piece[: total - written]
        n += chunk_lines
        written += len(piece)
        yield piece


def raw_s3(minio: Minio, bucket: str):
    """(put, get) straight through the minio client: the baseline every ratio divides by."""

    def raw_put(key: str, data: bytes) -> None:
        minio.put_object(bucket, key, io.BytesIO(data), len(data), content_type="text/plain; charset=utf-8")

    def raw_get(key: str) -> bytes:
        r = minio.get_object(bucket, key)
        try:
            return r.read()
        finally:
            r.close()
            r.release_conn()

    return raw_put, raw_get


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def summary(xs: list[float]) -> dict:
    return {"median_ms": round(statistics.median(xs) * 1000, 3), "p99_ms": round(pct(xs, 99) * 1000, 3),
            "min_ms": round(min(xs) * 1000, 3), "n": len(xs)}


async def side_by_side(n: int, warmup: int, first: int, put, get, raw_put, raw_get) -> tuple[list[float], ...]:
    """``n`` put+get pairs (after ``warmup`` unmeasured ones) of distinct 1 MiB texts (``blob_text(first + i)``),
    each timed beside the raw client's on the same bytes, the order alternating every iteration; reads of blobs
    never read before. ``put(i, text, data)`` returns what ``get`` takes. Returns the samples (put, raw put, get,
    raw get)."""
    samples: tuple[list[float], ...] = ([], [], [], [])
    for i in range(n + warmup):
        text = blob_text(first + i)
        data = text.encode()
        key = f"bench-raw/{uuid.uuid4().hex}"
        order = ("svc", "raw") if i % 2 == 0 else ("raw", "svc")
        puts, gets, ref = {}, {}, None
        for who in order:  # put side by side
            t0 = time.perf_counter()
            if who == "svc":
                ref = await put(i, text, data)
            else:
                raw_put(key, data)  # blocking, directly: the strictest baseline
            puts[who] = time.perf_counter() - t0
        for who in order:  # get side by side
            t0 = time.perf_counter()
            got = await get(ref) if who == "svc" else raw_get(key)
            gets[who] = time.perf_counter() - t0
            assert got == data
        if i >= warmup:
            for xs, x in zip(samples, (puts["svc"], puts["raw"], gets["svc"], gets["raw"]), strict=True):
                xs.append(x)
    return samples


async def measure(stack: Stack, n: int, warmup: int, pages: int, big_bytes: int) -> dict:
    env = stack.env
    minio = Minio(env["CTX_S3_ENDPOINT"].removeprefix("http://"), access_key=env["CTX_S3_ACCESS_KEY"],
                  secret_key=env["CTX_S3_SECRET_KEY"], secure=False)
    bucket = env["CTX_S3_BUCKET"]
    broker = NatsBroker(env["CTX_NATS_URL"], logger=None)
    await broker.connect()
    client = BlobClient(RpcClient(broker, default_timeout=60))
    conv = f"conv_bench_{uuid.uuid4().hex[:8]}"

    raw_put, raw_get = raw_s3(minio, bucket)

    async def svc_put(i: int, text: str, data: bytes) -> str:
        r = await client.put(text, conv, ("message", f"m{i}"), "tool_output")
        assert r["created"] and r["size"] == MIB
        return r["sha256"]

    async def svc_get(sha: str) -> bytes:
        return await client.get_bytes(conv, sha256=sha)

    svc_puts, raw_puts, svc_gets, raw_gets = await side_by_side(n, warmup, 0, svc_put, svc_get, raw_put, raw_get)

    # fs_read pages of a 100 MB blob
    t0 = time.perf_counter()
    big = await client.put(page_text_chunks(big_bytes), conv, ("message", "m-big"), "tool_output")
    upload_s = time.perf_counter() - t0
    total_lines = big["lines"]
    rnd = random.Random(7)
    fs_times = []
    for k in range(pages + 5):
        offset = rnd.randint(1, total_lines - 2000)
        t0 = time.perf_counter()
        page = await client.fs_read(conv, big["uri"], offset=offset, limit=2000)
        dt = time.perf_counter() - t0
        assert page["kind"] == "text" and page["endLine"] - page["startLine"] == 1999, page.get("code")
        if k >= 5:
            fs_times.append(dt)
    # context: the raw S3 client reading a comparable byte range of the same object (one 64 KiB seek window
    # + a 2,000-line page), at random offsets — the floor any fs_read page pays on this S3 server
    raw_range = []
    span = 64 * 1024 + 2000 * 17
    for k in range(min(pages, 100) + 5):
        start = rnd.randint(0, big["size"] - span)
        t0 = time.perf_counter()
        r = minio.get_object(bucket, f"blobs/{big['sha256']}", offset=start, length=span)
        try:
            assert len(r.read()) == span
        finally:
            r.close()
            r.release_conn()
        if k >= 5:
            raw_range.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    n_bytes = 0
    async for c in client.iter_chunks(conv, sha256=big["sha256"]):
        n_bytes += len(c)
    readback_s = time.perf_counter() - t0
    assert n_bytes == big["size"]
    await broker.stop()

    put_ratio = statistics.median(svc_puts) / statistics.median(raw_puts)
    get_ratio = statistics.median(svc_gets) / statistics.median(raw_gets)
    return {
        "put_ratio_vs_raw_s3": round(put_ratio, 3),
        "get_ratio_vs_raw_s3": round(get_ratio, 3),
        "target_ratio": TARGET_RATIO,
        "ratios_hold": put_ratio <= TARGET_RATIO and get_ratio <= TARGET_RATIO,
        "blob_bytes": MIB,
        "service_put": summary(svc_puts),
        "raw_s3_put": summary(raw_puts),
        "service_get": summary(svc_gets),
        "raw_s3_get": summary(raw_gets),
        "fs_read_2000_lines_100mb": {**summary(fs_times), "blob_bytes": big["size"], "total_lines": total_lines},
        "raw_s3_range_read_same_span_100mb": {**summary(raw_range), "span_bytes": span},
        "upload_100mb_s": round(upload_s, 3),
        "readback_100mb_s": round(readback_s, 3),
    }


async def run_floor(stack: Stack, n: int, warmup: int) -> dict:
    import nats

    env = stack.env
    minio = Minio(env["CTX_S3_ENDPOINT"].removeprefix("http://"), access_key=env["CTX_S3_ACCESS_KEY"],
                  secret_key=env["CTX_S3_SECRET_KEY"], secure=False)
    bucket = env["CTX_S3_BUCKET"]
    nc = await nats.connect(env["CTX_NATS_URL"])

    raw_put, raw_get = raw_s3(minio, bucket)

    try:
        return await measure_floor(nc, raw_put, raw_get, n, warmup)
    finally:
        await nc.close()


# ---------------------------------------------------------------------------------------- the claim-check floor
FLOOR_PUT, FLOOR_GET = "bench.floor.put", "bench.floor.get"


async def floor_responder() -> None:
    """The least a claim-check blob service can do here: a bare nats-py responder — no framework, no Postgres
    (no allow-list, no metadata, no lock), no contracts, no text index — that pulls an upload from the caller's
    inbox, hashes it and PUTs it (as the blob store does), and that GETs an object and
    pushes it to the caller's inbox (two messages: 1 MiB and its headers do not fit one). Context for the
    ratios: what the transport alone costs on this machine."""
    import nats
    from ctxbuild_blobstore.adapters.s3 import ObjectStore

    env = os.environ
    s3 = ObjectStore(env["CTX_S3_ENDPOINT"], env["CTX_S3_ACCESS_KEY"], env["CTX_S3_SECRET_KEY"], env["CTX_S3_BUCKET"])
    nc = await nats.connect(env["CTX_NATS_URL"])
    cut = nc.max_payload - 4096

    async def put(msg) -> None:
        req = json.loads(msg.data)
        data = (await nc.request(req["source"], b'{"seq":0}', timeout=10)).data
        sha = hashlib.sha256(data).hexdigest()
        await s3.put(f"bench-floor/{sha}", data)
        await nc.publish(msg.reply, json.dumps({"sha256": sha, "size": len(data)}).encode())

    async def get(msg) -> None:
        req = json.loads(msg.data)
        data = await s3.read(f"bench-floor/{req['sha256']}")
        for off in range(0, len(data), cut):
            await nc.publish(req["sink"], data[off:off + cut], headers={"Ctx-Blob-Offset": str(off)})
        await nc.publish(msg.reply, json.dumps({"size": len(data)}).encode())

    await nc.subscribe(FLOOR_PUT, cb=put)
    await nc.subscribe(FLOOR_GET, cb=get)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()


async def measure_floor(nc, raw_put, raw_get, n: int, warmup: int) -> dict:
    """The floor responder vs the raw client, interleaved, distinct content, cold reads, the caller verifying the
    read-back's sha256 as BlobClient does."""

    async def floor_put(data: bytes) -> str:
        inbox = nc.new_inbox()

        async def on_pull(msg) -> None:
            await nc.publish(msg.reply, data)

        sub = await nc.subscribe(inbox, cb=on_pull)
        try:
            return json.loads((await nc.request(FLOOR_PUT, json.dumps({"source": inbox}).encode(), timeout=30)).data)[
                "sha256"]
        finally:
            await sub.unsubscribe()

    async def floor_get(sha: str) -> bytes:
        inbox, got = nc.new_inbox(), asyncio.Queue()

        async def on_chunk(msg) -> None:
            got.put_nowait(msg.data)

        sub = await nc.subscribe(inbox, cb=on_chunk)
        try:
            size = json.loads((await nc.request(FLOOR_GET, json.dumps({"sha256": sha, "sink": inbox}).encode(),
                                                timeout=30)).data)["size"]
            parts, h, have = [], hashlib.sha256(), 0
            while have < size:
                c = await asyncio.wait_for(got.get(), 30)
                h.update(c)
                parts.append(c)
                have += len(c)
            assert h.hexdigest() == sha
            return b"".join(parts)
        finally:
            await sub.unsubscribe()

    async def put(i: int, text: str, data: bytes) -> str:
        return await floor_put(data)

    fp, rp, fg, rg = await side_by_side(n, warmup, 1_000_000, put, floor_get, raw_put, raw_get)
    return {"put_ratio_vs_raw_s3": round(statistics.median(fp) / statistics.median(rp), 3),
            "get_ratio_vs_raw_s3": round(statistics.median(fg) / statistics.median(rg), 3),
            "floor_put": summary(fp), "raw_s3_put": summary(rp), "floor_get": summary(fg), "raw_s3_get": summary(rg),
            "what": "bare nats-py responder: pull + hash + PUT; GET + 2-message push + caller's sha256 "
                    "check; no framework, Postgres, contracts or index"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("-n", type=int, default=60, help="measured 1 MiB put+get pairs")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--pages", type=int, default=200, help="fs_read samples")
    ap.add_argument("--big-mb", type=int, default=100)
    ap.add_argument("--floor-n", type=int, default=30, help="claim-check floor pairs (0: skip)")
    ap.add_argument("--floor-responder", action="store_true", help=argparse.SUPPRESS)  # the floor's process
    args = ap.parse_args()
    if args.floor_responder:
        asyncio.run(floor_responder())
        return
    if args.out is None:
        ap.error("--out is required")
    load_before = os.getloadavg()
    with private_stack("ctxbuild-bench-blob-", services=["blobstore"]) as stack:
        floor = None
        try:
            result = asyncio.run(measure(stack, args.n, args.warmup, args.pages, args.big_mb * 1000 * 1000))
            if args.floor_n:
                floor = subprocess.Popen([sys.executable, __file__, "--floor-responder"],
                                         env={**os.environ, **stack.env}, stdout=subprocess.PIPE)
                assert floor.stdout is not None and floor.stdout.readline().strip() == b"ready"
                result["claim_check_floor"] = asyncio.run(run_floor(stack, args.floor_n, args.warmup))
        finally:
            if floor is not None:
                floor.terminate()
                floor.wait()
    result["environment"] = {"python": platform.python_version(), "machine": platform.machine(),
                             "cpus": os.cpu_count(), "s3": "SeaweedFS (weed server -s3), loopback",
                             "postgres_fsync": True, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                             # other work on the machine inflates the multi-process service path far more than
                             # the single raw client: read the ratios with the load they were measured under
                             "loadavg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
