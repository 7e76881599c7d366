"""Benchmark: the event store (persistence service) side by side with a raw asyncpg INSERT loop.

Its own private stack (NATS + PostgreSQL + the persistence service, in a temporary folder, Postgres with fsync ON
like production), then:

1. append_ratio_vs_raw_insert — one 1 KB event per append through the service (`ctx.persist.append` over NATS:
   contract validation, expected version, advisory lock, event + outbox row in one transaction) vs one INSERT
   per row with asyncpg into an equivalent table of the same database (autocommit). Interleaved in rounds, so
   drift on a noisy host hits both sides alike. Ratio = service time per event / raw time per event.
2. events/s with 1 and 8 concurrent streams (one appender per stream, one event per append).
3. outbox lag: a core-NATS subscription on ctx.evt.> sees each event as the relay publishes it to JetStream;
   lag = seen − the append's acknowledgement (which the service sends after the commit, so this is an upper
   bound of commit → JetStream... minus the reply's own flight; a sample can be slightly negative when JetStream's
   copy arrives before the reply). Measured paced (one append every 5 ms) and under the 8-stream load.

    .venv/bin/python bench/eventstore.py --out bench/results/eventstore.json
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

import asyncpg
import nats
from ctxbuild_devstack import Stack, private_stack
from ctxbuild_persistence.adapters.db import Database
from ctxbuild_persistence.adapters.event_store import EventStore
from ctxbuild_persistence.domain.append import NewEvent
from ctxbuild_platform.rpc import RpcClient
from faststream.nats import NatsBroker

EVENT_BYTES = 1024
RAW_TABLE = """
CREATE SCHEMA IF NOT EXISTS bench_raw;
CREATE TABLE IF NOT EXISTS bench_raw.events (
    position     bigserial   PRIMARY KEY,
    stream_id    text        NOT NULL,
    version      integer     NOT NULL,
    event_id     uuid        NOT NULL UNIQUE,
    type         text        NOT NULL,
    data         json        NOT NULL,
    metadata     json        NOT NULL DEFAULT '{}',
    recorded_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (stream_id, version)
);"""


def payload(i: int) -> dict:
    """A 1 KB event body (compact JSON), distinct per event."""
    base = {"i": i, "pad": ""}
    fill = EVENT_BYTES - len(json.dumps(base, separators=(",", ":")))
    base["pad"] = (f"{i:08d}" * (fill // 8 + 1))[:fill]
    return base


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def summary(ms: list[float]) -> dict:
    return {"n": len(ms), "mean_ms": round(statistics.fmean(ms), 4), "p50_ms": round(pct(ms, 50), 4),
            "p99_ms": round(pct(ms, 99), 4), "events_per_s": round(1000 / statistics.fmean(ms), 1)}


class Lag:
    """Times at which each event id was seen on ctx.evt.> (core NATS) vs acknowledged to the appender."""

    def __init__(self) -> None:
        self.seen: dict[str, float] = {}
        self.acked: dict[str, float] = {}

    async def on_msg(self, msg) -> None:
        eid = (msg.headers or {}).get("Nats-Msg-Id")
        if eid:
            self.seen.setdefault(eid, time.perf_counter())

    async def samples(self, ids: list[str], timeout: float = 30.0) -> list[float]:
        deadline = time.monotonic() + timeout
        while any(i not in self.seen for i in ids) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        missing = [i for i in ids if i not in self.seen]
        if missing:
            raise RuntimeError(f"{len(missing)} events never reached ctx.evt.>")
        return [(self.seen[i] - self.acked[i]) * 1000 for i in ids]


async def run(stack: Stack, n_ratio: int, rounds: int, n_throughput: int, n_paced: int) -> dict:
    broker = NatsBroker(stack.env["CTX_NATS_URL"], logger=None)
    await broker.connect()
    rpc = RpcClient(broker, default_timeout=30)
    nc = await nats.connect(stack.env["CTX_NATS_URL"])
    lag = Lag()
    await nc.subscribe("ctx.evt.>", cb=lag.on_msg)
    await nc.flush()
    pool = await asyncpg.create_pool(stack.env["CTX_DATABASE_URL"], min_size=1, max_size=8)
    await pool.execute(RAW_TABLE)

    async def service_append(stream: str, version: int, i: int) -> str:
        eid = str(uuid.uuid4())
        await rpc.call("ctx.persist.append", {"streamId": stream, "expectedVersion": version, "events": [
            {"eventId": eid, "type": "BenchEvent", "data": payload(i)}]})
        lag.acked[eid] = time.perf_counter()
        return eid

    # warm-up: connections, prepared statements, the relay's stream
    warm = f"bench:{uuid.uuid4()}"
    for i in range(50):
        await service_append(warm, i, i)
    async with pool.acquire() as conn:
        for i in range(50):
            await conn.execute("INSERT INTO bench_raw.events (stream_id, version, event_id, type, data) "
                               "VALUES ($1, $2, $3, 'BenchEvent', $4::json)", warm, i + 1, uuid.uuid4(),
                               json.dumps(payload(i), separators=(",", ":")))

    # 1. service vs raw INSERT, interleaved; for the breakdown also the store's transaction alone (the service's
    #    EventStore from this process, no NATS) and a bare NATS request/reply of the same 1 KB
    async def echo(msg) -> None:
        await msg.respond(b'{"ok":true}')

    await nc.subscribe("bench.floor", cb=echo)
    store_db = Database(stack.env["CTX_DATABASE_URL"], min_size=1, max_size=2)
    await store_db.connect()
    store = EventStore(store_db)
    svc_ms: list[float] = []
    raw_ms: list[float] = []
    direct_ms: list[float] = []
    floor_ms: list[float] = []
    s_stream, r_stream, d_stream = (f"bench:{uuid.uuid4()}" for _ in range(3))
    s_ver = r_ver = d_ver = 0
    per_round = n_ratio // rounds
    async with pool.acquire() as conn:
        stmt = await conn.prepare("INSERT INTO bench_raw.events (stream_id, version, event_id, type, data) "
                                  "VALUES ($1, $2, $3, 'BenchEvent', $4::json)")
        for _ in range(rounds):
            for i in range(per_round):
                t0 = time.perf_counter()
                await service_append(s_stream, s_ver, i)
                svc_ms.append((time.perf_counter() - t0) * 1000)
                s_ver += 1
            for i in range(per_round):
                body = json.dumps(payload(i), separators=(",", ":"))
                t0 = time.perf_counter()
                await stmt.fetch(r_stream, r_ver + 1, uuid.uuid4(), body)
                raw_ms.append((time.perf_counter() - t0) * 1000)
                r_ver += 1
            for i in range(per_round // 2):
                ev = NewEvent(str(uuid.uuid4()), "BenchEvent", payload(i))
                t0 = time.perf_counter()
                await store.append(d_stream, d_ver, [ev])
                direct_ms.append((time.perf_counter() - t0) * 1000)
                d_ver += 1
                body = json.dumps({"streamId": s_stream, "expectedVersion": 0, "events": [
                    {"eventId": ev.event_id, "type": "BenchEvent", "data": payload(i)}]}).encode()
                t0 = time.perf_counter()
                await nc.request("bench.floor", body, timeout=10)
                floor_ms.append((time.perf_counter() - t0) * 1000)
    await store_db.close()
    ratio = statistics.fmean(svc_ms) / statistics.fmean(raw_ms)

    # 2. throughput at 1 and 8 concurrent streams (+ the outbox lag under that load)
    async def appender(count: int, ids: list[str]) -> None:
        stream = f"bench:{uuid.uuid4()}"
        for v in range(count):
            ids.append(await service_append(stream, v, v))

    throughput = {}
    loaded_ids: list[str] = []
    for streams in (1, 8):
        ids: list[str] = []
        t0 = time.perf_counter()
        await asyncio.gather(*(appender(n_throughput // streams, ids) for _ in range(streams)))
        elapsed = time.perf_counter() - t0
        throughput[f"streams_{streams}"] = {"streams": streams, "events": len(ids),
                                            "seconds": round(elapsed, 3),
                                            "events_per_s": round(len(ids) / elapsed, 1)}
        if streams == 8:
            loaded_ids = ids
    loaded = await lag.samples(loaded_ids)

    # 3. outbox lag, paced
    paced_ids: list[str] = []
    stream = f"bench:{uuid.uuid4()}"
    for v in range(n_paced):
        paced_ids.append(await service_append(stream, v, v))
        await asyncio.sleep(0.005)
    paced = await lag.samples(paced_ids)

    pg_version = await pool.fetchval("SHOW server_version")
    fsync = await pool.fetchval("SHOW fsync")
    await pool.execute("DROP SCHEMA bench_raw CASCADE")
    await pool.close()
    await nc.drain()
    await broker.stop()

    def lag_summary(xs: list[float]) -> dict:
        return {"n": len(xs), "p50_ms": round(pct(xs, 50), 3), "p99_ms": round(pct(xs, 99), 3),
                "max_ms": round(max(xs), 3), "negative_samples": sum(1 for x in xs if x < 0)}

    return {
        "benchmark": "eventstore",
        "event_bytes": EVENT_BYTES,
        "append_ratio_vs_raw_insert": round(ratio, 3),
        "append": {"service": summary(svc_ms), "raw_insert": summary(raw_ms), "rounds": rounds,
                   "note": "one event per append; service = ctx.persist.append round trip over NATS; raw = one "
                           "autocommitted asyncpg INSERT (prepared) into an equivalent table, same database"},
        "breakdown": {
            "store_transaction_only": summary(direct_ms),
            "store_ratio_vs_raw_insert": round(statistics.fmean(direct_ms) / statistics.fmean(raw_ms), 3),
            "bare_nats_request_reply_1kb": summary(floor_ms),
            "note": "store_transaction_only = the service's EventStore.append (advisory lock, version/id read, "
                    "event + outbox row, commit) called from the benchmark process; the rest of the service "
                    "time is the NATS hop, FastStream + OpenTelemetry + contract validation (request, event data, "
                    "reply) and the relay/projector work each append wakes in the same process"},
        "throughput": throughput,
        "outbox_lag_ms": {"paced_5ms": lag_summary(paced), "under_8_stream_load": lag_summary(loaded),
                          "note": "seen on ctx.evt.> (core NATS, published by the relay into JetStream) minus the "
                                  "append's acknowledgement time at the client"},
        "environment": {"postgres": pg_version, "postgres_fsync": fsync, "jetstream_sync": "always",
                        "python": platform.python_version(), "cpus": os.cpu_count(),
                        "platform": platform.platform()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/eventstore.json"))
    ap.add_argument("--n-ratio", type=int, default=2000, help="events per side for the ratio")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--n-throughput", type=int, default=2000, help="events per concurrency level")
    ap.add_argument("--n-paced", type=int, default=300)
    args = ap.parse_args()
    with private_stack("ctxbench-es-", infra=["nats", "postgres"], services=["persistence"]) as st:
        result = asyncio.run(run(st, args.n_ratio, args.rounds, args.n_throughput, args.n_paced))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
