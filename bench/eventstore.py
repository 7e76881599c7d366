"""Benchmark: the event store (persistence service) side by side with its floors, in one run.

Its own private stack (NATS + PostgreSQL + the persistence service, in a temporary folder, Postgres with fsync ON
like production), then:

1. Latency, one 1 KB event per append, interleaved in rounds (drift on a noisy host hits every side alike):
   - service: ``ctx.persist.append`` round trip over NATS (contract validation, expected version, the store's
     transaction: event + outbox row, commit, reply);
   - raw INSERT: one autocommitted, prepared asyncpg INSERT into a table of the same shape in the same database
     (so the same fsync / synchronous_commit settings) — no outbox row, no version read, no lock;
   - bare NATS request/reply: the same request bytes to a nats-py responder in its own process (the service is
     a process of its own too) that answers a fixed small reply — no framework, no validation, no database;
   - for context, the same request/reply to a responder inside the bench process, and the store's append called
     directly from the bench process (no NATS).
   ``append_ratio_vs_floor`` = service p50 / (bare NATS p50 + raw INSERT p50): the least any service that takes
   a request over NATS and commits a row could pay, measured in the same rounds.
2. Throughput with 1, 8 and 32 concurrent streams (one appender per stream, one event per append, appends of a
   stream in order) through the service, beside raw INSERT events/s with the same number of connections (one
   INSERT loop per connection, autocommit). Both run twice per level, the order alternating; events/s = events /
   wall time summed over the two runs. Measured with 1 persistence replica and again with 2 (a second process in
   the same queue group, ``ctxbuild_devstack.replica.Replica``). CPU seconds of the persistence process(es) and of
   Postgres (postmaster and its backends) over each service run give events per CPU-second; Postgres
   ``xact_commit`` and WAL bytes per event are read around one 32-stream service run.
   ``throughput_ratio_32_streams`` = service events/s / raw INSERT events/s at 32 (1 replica). Beside it, 32
   streams with 5 events per append (a step's events, which the runner appends together) vs raw transactions of
   5 INSERTs each.
3. Outbox lag: a core-NATS subscription on ctx.evt.> sees each event as the relay publishes it to JetStream;
   lag = seen − the append's acknowledgement at the client (an upper bound of commit → JetStream minus the
   reply's own flight; a sample can be slightly negative when JetStream's copy arrives before the reply).
   Measured paced (one append every 5 ms) and under the 8-stream load.

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
from ctxbuild_devstack.replica import Replica
from ctxbuild_persistence.adapters.db import Database
from ctxbuild_persistence.adapters.event_store import EventStore
from ctxbuild_persistence.domain.append import NewEvent
from ctxbuild_platform.rpc import RpcClient
from faststream.nats import NatsBroker
from proc_cpu import CpuGroup  # a sibling module (run from bench/)
from responder import start_floor_responder

EVENT_BYTES = 1024
LEVELS = (1, 8, 32)
STEP_EVENTS = 5  # events of one agent step (issue #21's projection: ~5 per step), appended together by the runner
TARGET_APPEND_RATIO_VS_FLOOR = 3.0
TARGET_THROUGHPUT_RATIO_32 = 0.5
FLOOR_SUBJECT = "bench.es.floor"
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
RAW_INSERT = ("INSERT INTO bench_raw.events (stream_id, version, event_id, type, data) "
              "VALUES ($1, $2, $3, 'BenchEvent', $4::json)")


def payload(i: int) -> dict:
    """A 1 KB event body (compact JSON), distinct per event."""
    base = {"i": i, "pad": ""}
    fill = EVENT_BYTES - len(json.dumps(base, separators=(",", ":")))
    base["pad"] = (f"{i:08d}" * (fill // 8 + 1))[:fill]
    return base


def body(i: int) -> str:
    return json.dumps(payload(i), separators=(",", ":"))


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def summary(ms: list[float]) -> dict:
    return {"n": len(ms), "mean_ms": round(statistics.fmean(ms), 4), "p50_ms": round(pct(ms, 50), 4),
            "p99_ms": round(pct(ms, 99), 4)}


class Lag:
    """Times at which each event id was seen on ctx.evt.> (core NATS) vs acknowledged to the appender."""

    def __init__(self) -> None:
        self.seen: dict[str, float] = {}
        self.acked: dict[str, float] = {}

    async def on_msg(self, msg) -> None:
        eid = (msg.headers or {}).get("Nats-Msg-Id")
        if eid:
            self.seen.setdefault(eid, time.perf_counter())

    async def samples(self, ids: list[str], timeout: float = 60.0) -> list[float]:
        deadline = time.monotonic() + timeout
        while any(i not in self.seen for i in ids) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        missing = [i for i in ids if i not in self.seen]
        if missing:
            raise RuntimeError(f"{len(missing)} events never reached ctx.evt.>")
        return [(self.seen[i] - self.acked[i]) * 1000 for i in ids]


# -------------------------------------------------------------------------------------- the bare NATS responder
async def floor_responder() -> None:
    """A bare nats-py responder in its own process: takes the request, answers a fixed small reply (what the
    service's reply weighs: ids, versions, positions), nothing else."""
    nc = await nats.connect(os.environ["CTX_NATS_URL"])
    reply = json.dumps({"result": {"streamId": "bench:x", "fromVersion": 1, "toVersion": 1, "positions": [1],
                                   "eventIds": [str(uuid.uuid4())]}}).encode()

    async def on_request(msg) -> None:
        await msg.respond(reply)

    await nc.subscribe(FLOOR_SUBJECT, cb=on_request)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()


# ---------------------------------------------------------------------------------------------------- the bench
class Bench:
    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.lag = Lag()

    async def open(self) -> None:
        url = self.stack.env["CTX_NATS_URL"]
        self.broker = NatsBroker(url, logger=None)
        await self.broker.connect()
        self.rpc = RpcClient(self.broker, default_timeout=60)
        self.nc = await nats.connect(url)
        await self.nc.subscribe("ctx.evt.>", cb=self.lag.on_msg)

        async def echo(msg) -> None:
            await msg.respond(b'{"ok":true}')

        await self.nc.subscribe("bench.es.inproc", cb=echo)
        await self.nc.flush()
        self.pool = await asyncpg.create_pool(self.stack.env["CTX_DATABASE_URL"], min_size=max(LEVELS),
                                              max_size=max(LEVELS))
        await self.pool.execute(RAW_TABLE)

    async def close(self) -> None:
        await self.pool.execute("DROP SCHEMA bench_raw CASCADE")
        await self.pool.close()
        await self.nc.drain()
        await self.broker.stop()

    def request(self, stream: str, version: int, i: int) -> tuple[str, dict]:
        eid = str(uuid.uuid4())
        return eid, {"streamId": stream, "expectedVersion": version,
                     "events": [{"eventId": eid, "type": "BenchEvent", "data": payload(i)}]}

    async def service_append(self, stream: str, version: int, i: int) -> str:
        eid, req = self.request(stream, version, i)
        await self.rpc.call("ctx.persist.append", req)
        self.lag.acked[eid] = time.perf_counter()
        return eid

    # ---------------------------------------------------------------------------------------------- latency
    async def latency(self, n: int, rounds: int) -> dict:
        store_db = Database(self.stack.env["CTX_DATABASE_URL"], min_size=1, max_size=2)
        await store_db.connect()
        store = EventStore(store_db)
        sides: dict[str, list[float]] = {k: [] for k in ("service", "raw_insert", "bare_nats", "inproc_nats",
                                                         "store_direct")}
        streams = {k: f"bench:{uuid.uuid4()}" for k in sides}
        versions = dict.fromkeys(sides, 0)
        per_round = max(1, n // rounds)

        async def one(side: str, conn, stmt, i: int) -> None:
            v = versions[side]
            if side == "service":
                eid, req = self.request(streams[side], v, i)
                t0 = time.perf_counter()
                await self.rpc.call("ctx.persist.append", req)
            elif side == "raw_insert":
                text, eid = body(i), uuid.uuid4()
                t0 = time.perf_counter()
                await stmt.fetch(streams[side], v + 1, eid, text)
            elif side == "store_direct":
                ev = NewEvent(str(uuid.uuid4()), "BenchEvent", payload(i))
                t0 = time.perf_counter()
                await store.append(streams[side], v, [ev])
            else:  # the same request bytes the service gets (the RPC client's JSON of the same request)
                data = json.dumps(self.request(streams[side], v, i)[1]).encode()
                subject = FLOOR_SUBJECT if side == "bare_nats" else "bench.es.inproc"
                t0 = time.perf_counter()
                await self.nc.request(subject, data, timeout=10)
            sides[side].append((time.perf_counter() - t0) * 1000)
            versions[side] = v + 1

        try:
            async with self.pool.acquire() as conn:
                stmt = await conn.prepare(RAW_INSERT)
                order = list(sides)
                for r in range(rounds):
                    # every side in turn, a few at a time, the order rotating each round
                    rot = order[r % len(order):] + order[:r % len(order)]
                    for start in range(0, per_round, 10):
                        for side in rot:
                            for i in range(start, min(per_round, start + 10)):
                                await one(side, conn, stmt, i)
        finally:
            await store_db.close()
        s = {k: summary(v) for k, v in sides.items()}
        floor_p50 = s["bare_nats"]["p50_ms"] + s["raw_insert"]["p50_ms"]
        return {
            "append_ratio_vs_floor": round(s["service"]["p50_ms"] / floor_p50, 3),
            "append_ratio_vs_raw_insert": round(s["service"]["p50_ms"] / s["raw_insert"]["p50_ms"], 3),
            "floor_p50_ms": round(floor_p50, 4),
            "service": s["service"], "raw_insert": s["raw_insert"], "bare_nats_request_reply": s["bare_nats"],
            "context": {"in_process_nats_request_reply": s["inproc_nats"], "store_append_direct": s["store_direct"],
                        "store_direct_ratio_vs_raw_insert": round(s["store_direct"]["p50_ms"]
                                                                  / s["raw_insert"]["p50_ms"], 3)},
            "rounds": rounds,
        }

    # ------------------------------------------------------------------------------------------- throughput
    async def service_run(self, streams: int, per_stream: int, ids: list[str], batch: int = 1) -> float:
        """``streams`` appenders, each appending ``per_stream`` events to its own stream in order, ``batch``
        events per append."""
        async def appender() -> None:
            stream = f"bench:{uuid.uuid4()}"
            for v in range(0, per_stream, batch):
                evs = [{"eventId": str(uuid.uuid4()), "type": "BenchEvent", "data": payload(v + j)}
                       for j in range(min(batch, per_stream - v))]
                await self.rpc.call("ctx.persist.append", {"streamId": stream, "expectedVersion": v, "events": evs})
                now = time.perf_counter()
                for e in evs:
                    self.lag.acked[e["eventId"]] = now
                    ids.append(e["eventId"])

        t0 = time.perf_counter()
        await asyncio.gather(*(appender() for _ in range(streams)))
        return time.perf_counter() - t0

    async def raw_run(self, conns: int, per_conn: int, batch: int = 1) -> float:
        """``conns`` connections, each inserting ``per_conn`` rows: one autocommitted INSERT per row, or
        ``batch`` rows per transaction (asyncpg executemany: one pipelined, atomic round of INSERTs)."""
        texts = [body(i) for i in range(per_conn)]

        async def inserter() -> None:
            stream = f"bench:{uuid.uuid4()}"
            async with self.pool.acquire() as conn:
                stmt = await conn.prepare(RAW_INSERT)
                for v in range(0, per_conn, batch):
                    if batch == 1:
                        await stmt.fetch(stream, v + 1, uuid.uuid4(), texts[v])
                    else:
                        await stmt.executemany([(stream, v + j + 1, uuid.uuid4(), texts[v + j])
                                                for j in range(min(batch, per_conn - v))])

        t0 = time.perf_counter()
        await asyncio.gather(*(inserter() for _ in range(conns)))
        return time.perf_counter() - t0

    async def throughput(self, events: dict[int, int], service_pids: list[int], pg: CpuGroup,
                         keep_ids: dict[int, list[str]] | None = None, batch: int = 1,
                         levels: tuple[int, ...] = LEVELS) -> dict:
        svc_cpu = CpuGroup(service_pids)
        out = {}
        for streams in levels:
            per = max(batch, events[streams] // streams // batch * batch)
            svc_s = raw_s = svc_cpu_s = pg_cpu_s = 0.0
            ids: list[str] = []
            for k in range(2):
                for side in (("service", "raw") if k == 0 else ("raw", "service")):
                    if side == "raw":
                        raw_s += await self.raw_run(streams, per, batch)
                        continue
                    c0, p0 = svc_cpu.seconds(), pg.seconds()
                    svc_s += await self.service_run(streams, per, ids, batch)
                    svc_cpu_s += svc_cpu.seconds() - c0
                    pg_cpu_s += pg.seconds() - p0
            if keep_ids is not None:
                keep_ids[streams] = ids
            n = 2 * per * streams
            svc_eps, raw_eps = n / svc_s, n / raw_s
            out[f"streams_{streams}"] = {
                "streams": streams, "events_per_append": batch, "events_per_run": per * streams,
                "service_events_per_s": round(svc_eps, 1), "raw_insert_events_per_s": round(raw_eps, 1),
                "ratio": round(svc_eps / raw_eps, 3),
                "service_cpu_s_per_1k_events": round(svc_cpu_s / n * 1000, 4),
                "postgres_cpu_s_per_1k_events": round(pg_cpu_s / n * 1000, 4),
                "service_events_per_cpu_s": round(n / svc_cpu_s, 1) if svc_cpu_s else None,
            }
        return out

    async def commits(self, streams: int, per_stream: int) -> dict:
        """Postgres transactions and WAL per event over one service run (the statistics are flushed by idle
        backends after a delay, hence the waits)."""
        q = ("SELECT xact_commit, pg_current_wal_lsn() AS lsn FROM pg_stat_database "
             "WHERE datname = current_database()")
        await asyncio.sleep(11)
        before = await self.pool.fetchrow(q)
        ids: list[str] = []
        wall = await self.service_run(streams, per_stream, ids)
        await asyncio.sleep(11)
        after = await self.pool.fetchrow(q)
        wal = await self.pool.fetchval("SELECT pg_wal_lsn_diff($1, $2)", after["lsn"], before["lsn"])
        n = len(ids)
        return {"streams": streams, "events": n, "events_per_s": round(n / wall, 1),
                "commits_per_event": round((after["xact_commit"] - before["xact_commit"]) / n, 3),
                "wal_bytes_per_event": round(float(wal) / n, 1),
                "note": "xact_commit counts every committed transaction of the database in the window: the appends, "
                        "the outbox relay's and the projector's, and the waits' own few reads"}


async def run(stack: Stack, args: argparse.Namespace) -> dict:
    b = Bench(stack)
    await b.open()
    responder = start_floor_responder(__file__, stack, "the bare NATS responder")
    pg = CpuGroup([stack.procs["postgres"]["pid"]])
    events = {1: args.events_1, 8: args.events_8, 32: args.events_32}
    result: dict = {"benchmark": "eventstore", "event_bytes": EVENT_BYTES}
    try:
        for i in range(50):  # warm-up: connections, prepared statements, the relay's stream
            await b.service_append(f"bench:warm:{i % 5}", i // 5, i)
        await b.raw_run(max(LEVELS), 5)
        await b.latency(100, 1)
        print("latency …", flush=True)
        lat = await b.latency(args.n_latency, args.rounds)
        print("throughput, 1 replica …", flush=True)
        loaded: dict[int, list[str]] = {}
        main_pid = stack.procs["persistence"]["pid"]
        tp1 = await b.throughput(events, [main_pid], pg, loaded)
        lag_loaded = await b.lag.samples(loaded[8])
        print("throughput, 1 replica, a step's events per append …", flush=True)
        batched: dict[int, list[str]] = {}
        tp1_batch = await b.throughput(events, [main_pid], pg, batched, batch=STEP_EVENTS, levels=(32,))
        await b.lag.samples(batched[32])  # the relay's backlog is published before the paced lag is measured
        paced_ids: list[str] = []
        stream = f"bench:{uuid.uuid4()}"
        for v in range(args.n_paced):
            paced_ids.append(await b.service_append(stream, v, v))
            await asyncio.sleep(0.005)
        lag_paced = await b.lag.samples(paced_ids)
        commits = await b.commits(32, max(1, args.events_32 // 32)) if args.commits else None
        print("throughput, 2 replicas …", flush=True)
        second = await asyncio.to_thread(lambda: Replica(stack, "persistence", "bench-persistence-2").wait_ready())
        try:
            await asyncio.sleep(1)  # its relay and projector settle (they poll)
            tp2 = await b.throughput(events, [main_pid, second.proc.pid], pg)
        finally:
            await asyncio.to_thread(second.stop)
        pg_version = await b.pool.fetchval("SHOW server_version")
        settings = {k: await b.pool.fetchval(f"SHOW {k}") for k in ("fsync", "synchronous_commit", "wal_sync_method")}
    finally:
        responder.terminate()
        responder.wait()
        await b.close()

    def lag_summary(xs: list[float]) -> dict:
        return {"n": len(xs), "p50_ms": round(pct(xs, 50), 3), "p99_ms": round(pct(xs, 99), 3),
                "max_ms": round(max(xs), 3), "negative_samples": sum(1 for x in xs if x < 0)}

    r32 = tp1["streams_32"]["ratio"]
    result.update({
        "append_ratio_vs_floor": lat["append_ratio_vs_floor"],
        "append_ratio_target": TARGET_APPEND_RATIO_VS_FLOOR,
        "throughput_ratio_32_streams": r32,
        "throughput_ratio_target": TARGET_THROUGHPUT_RATIO_32,
        "throughput_ratio_32_streams_2_replicas": tp2["streams_32"]["ratio"],
        "throughput_ratio_32_streams_5_per_append": tp1_batch["streams_32"]["ratio"],
        "targets_hold": lat["append_ratio_vs_floor"] <= TARGET_APPEND_RATIO_VS_FLOOR
        and r32 >= TARGET_THROUGHPUT_RATIO_32,
        "append_ratio_vs_raw_insert": lat["append_ratio_vs_raw_insert"],
        "append": lat,
        "throughput": {"replicas_1": tp1, "replicas_2": tp2, "replicas_1_5_per_append": tp1_batch},
        "postgres_per_event": commits,
        "outbox_lag_ms": {"paced_5ms": lag_summary(lag_paced), "under_8_stream_load": lag_summary(lag_loaded)},
        "how": {
            "append_ratio_vs_floor": "p50 of one ctx.persist.append (1 event of 1 KB) round trip / (p50 of a bare "
                                     "nats-py request/reply of the same request bytes to a responder in its own "
                                     "process that answers a fixed reply + p50 of one autocommitted prepared "
                                     "asyncpg INSERT of the same row into a table of the same shape in the same "
                                     "database), all measured in the same interleaved rounds",
            "throughput_ratio_32_streams": "events/s of 32 concurrent appenders through the service (one stream "
                                           "each, one event per append, in order) / events/s of 32 asyncpg "
                                           "connections each running autocommitted INSERTs of the same rows; two "
                                           "runs each, order alternating, 1 persistence replica",
            "throughput_ratio_32_streams_5_per_append": "the same with 5 events per append (a step's events, as the "
                                                        "runner appends them) beside raw transactions of 5 INSERTs "
                                                        "each (asyncpg executemany: pipelined, one commit)",
            "floors_exclude": "raw INSERT: no outbox row, no expected-version read, no lock, no idempotency check; "
                              "bare NATS: no FastStream, no validation, no tracing, no database",
            "cpu": "psutil user+system seconds of the persistence process(es) and of Postgres (postmaster, "
                   "backends, reaped children) over the service runs only; the bench client and NATS not "
                   "included",
        },
        "environment": {"postgres": pg_version, **{f"postgres_{k}": v for k, v in settings.items()},
                        "jetstream_sync": "always", "python": platform.python_version(), "cpus": os.cpu_count(),
                        "platform": platform.platform(),
                        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    })
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/eventstore.json"))
    ap.add_argument("--n-latency", type=int, default=600, help="samples per side for the latency ratio")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--events-1", type=int, default=300, help="events per run, 1 stream")
    ap.add_argument("--events-8", type=int, default=1600, help="events per run, 8 streams")
    ap.add_argument("--events-32", type=int, default=3200, help="events per run, 32 streams")
    ap.add_argument("--n-paced", type=int, default=200)
    ap.add_argument("--no-commits", dest="commits", action="store_false", help="skip the commits-per-event run")
    ap.add_argument("--floor-responder", action="store_true", help=argparse.SUPPRESS)  # the floor's process
    args = ap.parse_args()
    if args.floor_responder:
        asyncio.run(floor_responder())
        return
    load_before = os.getloadavg()
    with private_stack("ctxbench-es-", infra=["nats", "postgres"], services=["persistence"]) as st:
        result = asyncio.run(run(st, args))
    result["environment"]["loadavg_1m_before_after"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
