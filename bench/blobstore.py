"""Benchmark: the blob store vs its claim-check floor and the raw S3 client, side by side in one run.

- put+get of 1 MiB text blobs, three sides interleaved in one loop (the order rotating every iteration, so drift on
  a noisy host hits every side alike), distinct content per iteration (no dedup shortcut), reads of objects never
  read before (no warm cache):
  - service: ``BlobClient.put`` (chunked upload over NATS — 1 MiB does not fit one message with its JSON — S3
    write, metadata + reference in Postgres) and ``BlobClient.get_bytes`` (access check in Postgres, S3 read,
    chunks pushed over NATS, sha256 verified by the client);
  - claim-check floor: a bare nats-py responder in its own process (the service is one too) doing only the
    transport the service's transfer needs — put: the request, one pull of the caller's inbox answered with the
    whole 1 MiB, sha256 + the same S3 adapter's PUT, the reply; get: the request, the same S3 adapter's GET, two
    pushed messages (1 MiB and its headers do not fit one), the reply, and the caller's sha256 check — with no
    framework, Postgres, contracts, flow-control acknowledgements, end-of-data pull or text index;
  - raw: ``minio.put_object`` / ``get_object`` of the same bytes (blocking, directly).
  ``put_ratio_vs_floor`` / ``get_ratio_vs_floor`` = median(service) / median(floor); the ratios vs raw S3 of the
  service and of the floor are reported beside them.
- fs_read of a 2,000-line page at random offsets of a 100 MB blob (17-byte lines, so a full page fits the
  default 50,000-char cap): median and p99, beside the raw client reading a comparable byte range.

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
import time
import uuid
from pathlib import Path

from ctxbuild_blobclient import BlobClient
from ctxbuild_devstack import Stack, private_stack
from ctxbuild_platform.rpc import RpcClient
from faststream.nats import NatsBroker
from minio import Minio
from responder import start_floor_responder  # a sibling module (run from bench/)

MIB = 1024 * 1024
TARGET_RATIO_VS_FLOOR = 1.3  # issue #21: service / claim-check floor, same run


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


async def side_by_side(n: int, warmup: int, sides: dict) -> dict[str, dict[str, list[float]]]:
    """``n`` put+get pairs (after ``warmup`` unmeasured ones) of distinct 1 MiB texts per side, the sides' order
    rotating every iteration; every side puts the same bytes (under its own key) and then reads back its own
    object, never read before. ``sides[name] = (put, get)``: ``await put(i, text, data)`` returns what
    ``await get(ref)`` takes (sync callables are run directly, blocking: the strictest baseline)."""
    names = list(sides)
    samples = {name: {"put": [], "get": []} for name in names}

    async def call(fn, *a):
        r = fn(*a)
        return await r if asyncio.iscoroutine(r) else r

    for i in range(n + warmup):
        text = blob_text(i)
        data = text.encode()
        order = names[i % len(names):] + names[:i % len(names)]
        if (i // len(names)) % 2:
            order.reverse()
        puts, gets, refs = {}, {}, {}
        for who in order:  # put side by side
            t0 = time.perf_counter()
            refs[who] = await call(sides[who][0], i, text, data)
            puts[who] = time.perf_counter() - t0
        for who in order:  # get side by side
            t0 = time.perf_counter()
            got = await call(sides[who][1], refs[who])
            gets[who] = time.perf_counter() - t0
            assert got == data, who
        if i >= warmup:
            for who in names:
                samples[who]["put"].append(puts[who])
                samples[who]["get"].append(gets[who])
    return samples


# ---------------------------------------------------------------------------------------- the claim-check floor
FLOOR_PUT, FLOOR_GET = "bench.floor.put", "bench.floor.get"


async def floor_responder() -> None:
    """The least a claim-check blob service can do here: a bare nats-py responder — no framework, no Postgres
    (no allow-list, no metadata, no lock), no contracts, no text index — that pulls an upload from the caller's
    inbox in one message, hashes it and PUTs it (the blob store's own S3 adapter), and that GETs an object and
    pushes it to the caller's inbox (two messages: 1 MiB and its headers do not fit one), unacknowledged."""
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


def floor_client(nc):
    """(put, get) of the floor as its caller does them: serve one pull from a private inbox; read the pushed
    chunks from another and check their sha256 (as BlobClient does)."""

    async def floor_put(i: int, text: str, data: bytes) -> str:
        inbox = nc.new_inbox()

        async def on_pull(msg) -> None:
            await nc.publish(msg.reply, data)

        sub = await nc.subscribe(inbox, cb=on_pull)
        try:
            reply = await nc.request(FLOOR_PUT, json.dumps({"source": inbox}).encode(), timeout=30)
            return json.loads(reply.data)["sha256"]
        finally:
            await sub.unsubscribe()

    async def floor_get(sha: str) -> bytes:
        inbox, got = nc.new_inbox(), asyncio.Queue()

        async def on_chunk(msg) -> None:
            got.put_nowait(msg.data)

        sub = await nc.subscribe(inbox, cb=on_chunk)
        try:
            reply = await nc.request(FLOOR_GET, json.dumps({"sha256": sha, "sink": inbox}).encode(), timeout=30)
            size = json.loads(reply.data)["size"]
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

    return floor_put, floor_get


# ---------------------------------------------------------------------------------------------------- the run
async def measure(stack: Stack, n: int, warmup: int, pages: int, big_bytes: int) -> dict:
    import nats

    env = stack.env
    minio = Minio(env["CTX_S3_ENDPOINT"].removeprefix("http://"), access_key=env["CTX_S3_ACCESS_KEY"],
                  secret_key=env["CTX_S3_SECRET_KEY"], secure=False)
    bucket = env["CTX_S3_BUCKET"]
    broker = NatsBroker(env["CTX_NATS_URL"], logger=None)
    await broker.connect()
    client = BlobClient(RpcClient(broker, default_timeout=60))
    nc = await nats.connect(env["CTX_NATS_URL"])  # the floor's caller: plain nats-py, its own connection
    conv = f"conv_bench_{uuid.uuid4().hex[:8]}"

    raw_put, raw_get = raw_s3(minio, bucket)

    def raw_put_key(i: int, text: str, data: bytes) -> str:
        key = f"bench-raw/{uuid.uuid4().hex}"
        raw_put(key, data)
        return key

    async def svc_put(i: int, text: str, data: bytes) -> str:
        r = await client.put(text, conv, ("message", f"m{i}"), "tool_output")
        assert r["created"] and r["size"] == MIB
        return r["sha256"]

    async def svc_get(sha: str) -> bytes:
        return await client.get_bytes(conv, sha256=sha)

    s = await side_by_side(n, warmup, {"service": (svc_put, svc_get), "floor": floor_client(nc),
                                       "raw": (raw_put_key, raw_get)})
    await nc.close()

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

    def ratio(a: str, b: str, op: str) -> float:
        return round(statistics.median(s[a][op]) / statistics.median(s[b][op]), 3)

    put_vs_floor, get_vs_floor = ratio("service", "floor", "put"), ratio("service", "floor", "get")
    return {
        "put_ratio_vs_floor": put_vs_floor,
        "get_ratio_vs_floor": get_vs_floor,
        "target_ratio_vs_floor": TARGET_RATIO_VS_FLOOR,
        "ratios_hold": put_vs_floor <= TARGET_RATIO_VS_FLOOR and get_vs_floor <= TARGET_RATIO_VS_FLOOR,
        "put_ratio_vs_raw_s3": ratio("service", "raw", "put"),
        "get_ratio_vs_raw_s3": ratio("service", "raw", "get"),
        "floor_put_ratio_vs_raw_s3": ratio("floor", "raw", "put"),
        "floor_get_ratio_vs_raw_s3": ratio("floor", "raw", "get"),
        "blob_bytes": MIB,
        "service_put": summary(s["service"]["put"]),
        "floor_put": summary(s["floor"]["put"]),
        "raw_s3_put": summary(s["raw"]["put"]),
        "service_get": summary(s["service"]["get"]),
        "floor_get": summary(s["floor"]["get"]),
        "raw_s3_get": summary(s["raw"]["get"]),
        "how": {
            "ratios": "median of the service's 1 MiB put (get) / median of the claim-check floor's, the three sides "
                      "interleaved in one loop (order rotating), each put and get of every side on the same bytes",
            "claim_check_floor": "a bare nats-py responder in its own process: put = request + one pull answered "
                                 "with the whole 1 MiB + sha256 + S3 PUT (the blob store's own S3 adapter) + reply; "
                                 "get = request + S3 GET + two pushed messages + reply + the caller's sha256 check; "
                                 "no framework, Postgres, contracts, acknowledgements, end-of-data pull or index",
            "raw_s3": "minio put_object / get_object of the same bytes from the bench process (blocking)",
        },
        "fs_read_2000_lines_100mb": {**summary(fs_times), "blob_bytes": big["size"], "total_lines": total_lines},
        "raw_s3_range_read_same_span_100mb": {**summary(raw_range), "span_bytes": span},
        "upload_100mb_s": round(upload_s, 3),
        "readback_100mb_s": round(readback_s, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("-n", type=int, default=60, help="measured 1 MiB put+get pairs per side")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--pages", type=int, default=200, help="fs_read samples")
    ap.add_argument("--big-mb", type=int, default=100)
    ap.add_argument("--floor-responder", action="store_true", help=argparse.SUPPRESS)  # the floor's process
    args = ap.parse_args()
    if args.floor_responder:
        asyncio.run(floor_responder())
        return
    if args.out is None:
        ap.error("--out is required")
    load_before = os.getloadavg()
    with private_stack("ctxbuild-bench-blob-", services=["blobstore"]) as stack:
        floor = start_floor_responder(__file__, stack, "the claim-check floor responder")
        try:
            result = asyncio.run(measure(stack, args.n, args.warmup, args.pages, args.big_mb * 1000 * 1000))
        finally:
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
