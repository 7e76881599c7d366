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
   wall time summed over the two runs. The service side's load generator is as lean as the raw side's (the bench
   shares the two cores with the service, so its own CPU is taken from the service): every request built and
   JSON-encoded before the timed run (the raw side pre-builds its rows), sent with nats-py's request on a plain
   connection, each reply checked (``{"result": …}`` with the expected toVersion; anything else fails the bench).
   With 1 replica a relayed floor runs in the same rounds too: each connection INSERTs its rows and publishes each
   committed row to a JetStream file stream of the same server (pipelined, every ack awaited) — the per-event work
   the outbox relay adds to a commit, which raw INSERT leaves out (``throughput_ratio_32_streams_vs_relayed_floor``);
   and the same floor with its publishes spread over 4 JetStream streams (``relayed_floor_partitioned``): each
   stream flushes its stores one at a time under ``sync: always``, so this shows whether partitioning lifts the cap.
   And a service floor (``StoreFloor``): a bare nats-py responder in its own process that INSERTs each request's
   event, replies, and publishes the event to JetStream — the least a NATS service that commits and relays each
   event does, driven by the same generator (``throughput_ratio_32_streams_vs_service_floor``).
   With 1 replica the platform's ``RpcClient`` (claim check, a producer span per request, each event built in the
   loop) runs in the same rounds as a third side: ``throughput_ratio_32_streams_rpc_client``. A CPU census per
   level and side (``cpu_s_per_1k_events``): the bench process itself, nats-server, Postgres and the persistence
   process(es) (``cores_busy``: their sum / wall time); the persistence figure also as events per CPU-second.
   After each level every event appended through the service is looked up on JetStream (the ``CTX_EVENTS``
   stream read from where the last check stopped): the relay keeps up and never skips. Measured with 1
   persistence replica and again with 2 (a second process in the same queue group,
   ``ctxbuild_devstack.replica.Replica``). Postgres ``xact_commit`` and WAL bytes per event are read around one
   32-stream service run.
   ``throughput_ratio_32_streams`` = service events/s / raw INSERT events/s at 32 (1 replica). Beside it, 32
   streams with 5 events per append (a step's events, which the runner appends together) vs raw transactions of
   5 INSERTs each.
3. Outbox lag, in phases of its own (nothing subscribes to ctx.evt.> during the throughput runs: a callback
   per relayed event in the bench process would take CPU from the service): a core-NATS subscription on ctx.evt.>
   sees each event as the relay publishes it to JetStream; lag = seen − the append's acknowledgement at the
   client (an upper bound of commit → JetStream minus the reply's own flight; a sample can be slightly negative
   when JetStream's copy arrives before the reply). Measured before the throughput runs under an 8-stream load
   and paced (one append every 5 ms), and the 8-stream load again after the 1-replica throughput runs.

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
from ctxbuild_platform.claims import encode_json
from ctxbuild_platform.rpc import RpcClient
from faststream.nats import NatsBroker
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from proc_cpu import CpuGroup  # a sibling module (run from bench/)
from responder import start_floor_responder

EVENT_BYTES = 1024
LEVELS = (1, 8, 32)
STEP_EVENTS = 5  # events of one agent step (issue #21's projection: ~5 per step), appended together by the runner
TARGET_APPEND_RATIO_VS_FLOOR = 3.0
TARGET_THROUGHPUT_RATIO_32 = 0.5
FLOOR_SUBJECT = "bench.es.floor"
# the relayed floor's own JetStream stream (file storage, the stack's NATS: sync_interval always, as CTX_EVENTS)
RELAYED_STREAM, RELAYED_SUBJECT = "BENCH_RAW_EVENTS", "bench.raw.evt"
# the same floor spread over RELAYED_PARTITIONS streams (the connections evenly, as a hash of the stream id would on
# average): does a JetStream store per event still cap the floor when the stores are not serialised in one stream?
RELAYED_PARTITIONS = 4
RELAYED_PART_STREAM, RELAYED_PART_SUBJECT = "BENCH_RAW_EVENTS_P", "bench.rawp"
# the service floor (StoreFloor, in the floor responder's process)
STORE_FLOOR_SUBJECT, STORE_FLOOR_SETTLE = "bench.es.store_floor", "bench.es.store_floor.settle"
STORE_FLOOR_STREAM, STORE_FLOOR_EVENTS = "BENCH_STORE_FLOOR", "bench.sf.evt"
APPEND_SUBJECT = "ctx.persist.append"
EVENTS_STREAM, EVENTS_SUBJECTS = "CTX_EVENTS", "ctx.evt.>"  # where the outbox relay publishes (persistence settings)
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
    """Times at which each event id was seen on ctx.evt.> (core NATS) vs acknowledged to the appender. Subscribed
    only during the lag phase: during the throughput runs a callback per relayed event in the bench process would
    take CPU from the service on the same cores."""

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


class Relayed:
    """Every appended event must reach JetStream (the relay keeps up and never skips): checked after the timed runs
    by reading the stream itself from where the last check stopped (an ephemeral pull consumer, headers only), so
    nothing listens to the relay while events/s are measured."""

    def __init__(self, nc: nats.NATS) -> None:
        self.js = nc.jetstream()
        self.next_seq = 1
        self.seen: set[str] = set()

    async def wait_all(self, ids: list[str], timeout: float = 60.0) -> None:
        missing = set(ids) - self.seen
        if not missing:
            return
        sub = await self.js.pull_subscribe(
            EVENTS_SUBJECTS, stream=EVENTS_STREAM,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.next_seq,
                                  ack_policy=AckPolicy.NONE, headers_only=True, inactive_threshold=30.0))
        deadline = time.monotonic() + timeout
        try:
            while missing and time.monotonic() < deadline:
                try:
                    msgs = await sub.fetch(1000, timeout=1)
                except NatsTimeout:
                    continue  # the relay is still behind
                for m in msgs:
                    eid = (m.headers or {}).get("Nats-Msg-Id")
                    if eid:
                        self.seen.add(eid)
                        missing.discard(eid)
                    self.next_seq = m.metadata.sequence.stream + 1
        finally:
            await sub.unsubscribe()
        if missing:
            raise RuntimeError(f"{len(missing)} of {len(ids)} appended events never reached {EVENTS_STREAM}")


class Appends:
    """One appender's requests, built and JSON-encoded before the timed section (as the raw side pre-builds its
    rows): the request bytes, the toVersion its reply must carry, its event ids."""

    def __init__(self, per_stream: int, batch: int) -> None:
        stream = f"bench:{uuid.uuid4()}"
        self.requests: list[tuple[bytes, int, list[str]]] = []
        for v in range(0, per_stream, batch):
            evs = [{"eventId": str(uuid.uuid4()), "type": "BenchEvent", "data": payload(v + j)}
                   for j in range(min(batch, per_stream - v))]
            req = {"streamId": stream, "expectedVersion": v, "events": evs}
            self.requests.append((encode_json(req), v + len(evs), [e["eventId"] for e in evs]))

    def ids(self) -> list[str]:
        return [i for _, _, ids in self.requests for i in ids]


def check_reply(raw: bytes, to_version: int) -> None:
    """An append counts only when the service says it committed it: an error reply fails the bench."""
    reply = json.loads(raw)
    result = reply.get("result") if isinstance(reply, dict) else None
    if not isinstance(result, dict) or result.get("toVersion") != to_version:
        raise RuntimeError(f"append not committed (expected toVersion {to_version}): {raw[:300]!r}")


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
    await StoreFloor(nc).start()
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()


class StoreFloor:
    """The service floor of the throughput rounds, in the responder's process: the least a NATS service that
    commits each event and relays it to JetStream does per append, with no framework, no validation, no outbox table
    and no group commit. Per request (``STORE_FLOOR_SUBJECT``, the append's own bytes): decode it, INSERT each event
    (a prepared, autocommitted asyncpg INSERT on a pooled connection, as raw INSERT), answer ``{"result": …}``
    with the toVersion, then publish each event to JetStream (``STORE_FLOOR_STREAM``, ``Nats-Msg-Id``), pipelined
    and not waited for before the reply — as the service's relay publishes after the commit. A request on
    ``STORE_FLOOR_SETTLE`` waits for every publish's ack and answers how many were stored."""

    def __init__(self, nc: nats.NATS) -> None:
        self.nc = nc
        self.js = nc.jetstream(publish_async_max_pending=100_000)
        self.acks: list[asyncio.Future] = []
        self.tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self.pool = await asyncpg.create_pool(os.environ["CTX_DATABASE_URL"], min_size=max(LEVELS),
                                              max_size=max(LEVELS))
        await self.js.add_stream(name=STORE_FLOOR_STREAM, subjects=[f"{STORE_FLOOR_EVENTS}.>"], storage="file")
        await self.nc.subscribe(STORE_FLOOR_SUBJECT, cb=self.on_append)
        await self.nc.subscribe(STORE_FLOOR_SETTLE, cb=self.on_settle)

    async def on_append(self, msg) -> None:
        # nats-py runs a subscription's callbacks one at a time: each request gets a task, as concurrent as the
        # service's handlers
        task = asyncio.create_task(self.append(msg))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def append(self, msg) -> None:
        req = json.loads(msg.data)
        events, stream, version = req["events"], req["streamId"], req["expectedVersion"]
        texts = [json.dumps(e["data"]) for e in events]
        async with self.pool.acquire() as conn:
            for k, (e, text) in enumerate(zip(events, texts, strict=True), 1):
                # the connection's statement cache: prepared once per connection, as raw INSERT's statement
                await conn.execute(RAW_INSERT, stream, version + k, e["eventId"], text)
        await msg.respond(json.dumps({"result": {"streamId": stream, "toVersion": version + len(events)}}).encode())
        for e, text in zip(events, texts, strict=True):
            self.acks.append(await self.js.publish_async(f"{STORE_FLOOR_EVENTS}.{e['type']}", text.encode(),
                                                         headers={"Nats-Msg-Id": e["eventId"]}))

    async def on_settle(self, msg) -> None:
        acks, self.acks = self.acks, []
        await asyncio.gather(*acks)
        await msg.respond(json.dumps({"stored": len(acks)}).encode())


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
        self.nc = await nats.connect(url)  # a plain connection: the lean load generator's and the floors'
        self.relayed = Relayed(self.nc)

        async def echo(msg) -> None:
            await msg.respond(b'{"ok":true}')

        await self.nc.subscribe("bench.es.inproc", cb=echo)
        await self.nc.flush()
        self.js = self.nc.jetstream()
        await self.js.add_stream(name=RELAYED_STREAM, subjects=[f"{RELAYED_SUBJECT}.>"], storage="file")
        for k in range(RELAYED_PARTITIONS):
            await self.js.add_stream(name=f"{RELAYED_PART_STREAM}{k}", subjects=[f"{RELAYED_PART_SUBJECT}.{k}.>"],
                                     storage="file")
        self.pool = await asyncpg.create_pool(self.stack.env["CTX_DATABASE_URL"], min_size=max(LEVELS),
                                              max_size=max(LEVELS))
        await self.pool.execute(RAW_TABLE)

    async def close(self) -> None:
        await self.js.delete_stream(RELAYED_STREAM)
        for k in range(RELAYED_PARTITIONS):
            await self.js.delete_stream(f"{RELAYED_PART_STREAM}{k}")
        await self.pool.execute("DROP SCHEMA bench_raw CASCADE")
        await self.pool.close()
        await self.nc.drain()
        await self.broker.stop()

    def request(self, stream: str, version: int, i: int) -> tuple[str, dict]:
        eid = str(uuid.uuid4())
        return eid, {"streamId": stream, "expectedVersion": version,
                     "events": [{"eventId": eid, "type": "BenchEvent", "data": payload(i)}]}

    async def lean_append(self, data: bytes, to_version: int, subject: str = APPEND_SUBJECT) -> None:
        msg = await self.nc.request(subject, data, timeout=60)
        check_reply(msg.data, to_version)

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
    async def service_run(self, streams: int, per_stream: int, ids: list[str], batch: int = 1,
                          subject: str = APPEND_SUBJECT) -> float:
        """The lean load generator: ``streams`` appenders, each sending ``per_stream`` events to its own stream in
        order, ``batch`` events per append, with nats-py's request on a plain connection; each reply checked.
        ``subject``: the service's, or the service floor's."""
        plans = [Appends(per_stream, batch) for _ in range(streams)]
        for plan in plans:
            ids.extend(plan.ids())

        async def appender(plan: Appends) -> None:
            for data, to_version, _ in plan.requests:
                await self.lean_append(data, to_version, subject)

        t0 = time.perf_counter()
        await asyncio.gather(*(appender(plan) for plan in plans))
        return time.perf_counter() - t0

    async def store_floor_run(self, streams: int, per_stream: int) -> float:
        """The service floor (:class:`StoreFloor`) driven as the service is (the same lean generator, the same
        request bytes and reply check); then, outside the timed run, every publish of the run must be acked."""
        wall = await self.service_run(streams, per_stream, [], subject=STORE_FLOOR_SUBJECT)
        settled = json.loads((await self.nc.request(STORE_FLOOR_SETTLE, b"", timeout=120)).data)["stored"]
        if settled != streams * per_stream:
            raise RuntimeError(f"the service floor stored {settled} of {streams * per_stream} events on JetStream")
        return wall

    async def rpc_client_run(self, streams: int, per_stream: int, ids: list[str], batch: int = 1) -> float:
        """The previous load generator, kept as a second figure: the platform's RpcClient (claim check, JSON
        encoding, a producer span per request), each event built inside the timed loop."""
        async def appender() -> None:
            stream = f"bench:{uuid.uuid4()}"
            for v in range(0, per_stream, batch):
                evs = [{"eventId": str(uuid.uuid4()), "type": "BenchEvent", "data": payload(v + j)}
                       for j in range(min(batch, per_stream - v))]
                await self.rpc.call(APPEND_SUBJECT, {"streamId": stream, "expectedVersion": v, "events": evs})
                ids.extend(e["eventId"] for e in evs)

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

    async def raw_relayed_run(self, conns: int, per_conn: int, partitions: int = 1) -> float:
        """The relayed floor: ``conns`` connections, each inserting ``per_conn`` rows (one autocommitted INSERT
        each, as :meth:`raw_run`) and publishing each row, once committed, to JetStream (its own file stream on the
        same server, ``Nats-Msg-Id`` = the event id), pipelined; the run ends when every publish is acknowledged.
        What any store that commits an event and hands it to JetStream pays per event, without a service. With
        ``partitions`` > 1 the rows go to that many streams, the connections spread evenly over them (as a hash of
        the stream id would on average)."""
        texts = [body(i) for i in range(per_conn)]

        async def inserter(i: int) -> None:
            stream = f"bench:{uuid.uuid4()}"
            subject = (f"{RELAYED_SUBJECT}.BenchEvent" if partitions == 1 else
                       f"{RELAYED_PART_SUBJECT}.{i % partitions}.BenchEvent")
            acks = []
            async with self.pool.acquire() as conn:
                stmt = await conn.prepare(RAW_INSERT)
                for v in range(per_conn):
                    eid = uuid.uuid4()
                    await stmt.fetch(stream, v + 1, eid, texts[v])
                    acks.append(await self.js.publish_async(subject, texts[v].encode(),
                                                            headers={"Nats-Msg-Id": str(eid)}))
            for ack in acks:
                await ack  # every event stored on JetStream, or the bench fails

        t0 = time.perf_counter()
        await asyncio.gather(*(inserter(i) for i in range(conns)))
        return time.perf_counter() - t0

    async def throughput(self, events: dict[int, int], cpu: dict[str, CpuGroup], batch: int = 1,
                         levels: tuple[int, ...] = LEVELS, rpc_client: bool = False) -> dict:
        """Per level, each side twice, the order reversed the second time; ``cpu`` names the process groups of the
        census (read around every run). Every event appended through the service is then checked on JetStream."""
        sides: tuple[str, ...] = ("service", "raw_insert")
        if rpc_client:  # the 1-replica runs: the platform's client and the relayed floors too, same rounds
            sides = ("service", "service_rpc_client", "raw_insert", "raw_insert_relayed",
                     "raw_insert_relayed_partitioned", "service_floor")
        out = {}
        for streams in levels:
            print(f"  {streams} streams …", flush=True)
            per = max(batch, events[streams] // streams // batch * batch)
            wall = dict.fromkeys(sides, 0.0)
            used = {side: dict.fromkeys(cpu, 0.0) for side in sides}
            ids: list[str] = []
            for k in range(2):
                for side in (sides if k == 0 else sides[::-1]):
                    before = {name: g.seconds() for name, g in cpu.items()}
                    if side == "raw_insert":
                        wall[side] += await self.raw_run(streams, per, batch)
                    elif side == "raw_insert_relayed":
                        wall[side] += await self.raw_relayed_run(streams, per)
                    elif side == "raw_insert_relayed_partitioned":
                        wall[side] += await self.raw_relayed_run(streams, per, RELAYED_PARTITIONS)
                    elif side == "service_floor":
                        wall[side] += await self.store_floor_run(streams, per)
                    elif side == "service":
                        wall[side] += await self.service_run(streams, per, ids, batch)
                    else:
                        wall[side] += await self.rpc_client_run(streams, per, ids, batch)
                    for name, g in cpu.items():
                        used[side][name] += g.seconds() - before[name]
            await self.relayed.wait_all(ids)  # outside the timed runs: the relay published every event
            n = 2 * per * streams
            eps = {side: n / wall[side] for side in sides}
            census = {side: {**{name: round(used[side][name] / n * 1000, 4) for name in cpu},
                             "total": round(sum(used[side].values()) / n * 1000, 4),
                             "cores_busy": round(sum(used[side].values()) / wall[side], 2)} for side in sides}
            level = {
                "streams": streams, "events_per_append": batch, "events_per_run": per * streams,
                "service_events_per_s": round(eps["service"], 1),
                "raw_insert_events_per_s": round(eps["raw_insert"], 1),
                "ratio": round(eps["service"] / eps["raw_insert"], 3),
                "service_cpu_s_per_1k_events": census["service"]["service"],
                "postgres_cpu_s_per_1k_events": census["service"]["postgres"],
                "service_events_per_cpu_s": round(n / used["service"]["service"], 1)
                if used["service"]["service"] else None,
                "cpu_s_per_1k_events": census,
            }
            if rpc_client:
                level["rpc_client"] = {"service_events_per_s": round(eps["service_rpc_client"], 1),
                                       "ratio": round(eps["service_rpc_client"] / eps["raw_insert"], 3)}
                level["relayed_floor"] = {"events_per_s": round(eps["raw_insert_relayed"], 1),
                                          "ratio": round(eps["service"] / eps["raw_insert_relayed"], 3),
                                          "over_raw_insert": round(eps["raw_insert_relayed"] / eps["raw_insert"], 3)}
                part = eps["raw_insert_relayed_partitioned"]
                level["relayed_floor_partitioned"] = {"jetstream_streams": RELAYED_PARTITIONS,
                                                      "events_per_s": round(part, 1),
                                                      "ratio": round(eps["service"] / part, 3),
                                                      "over_raw_insert": round(part / eps["raw_insert"], 3)}
                floor = eps["service_floor"]
                level["service_floor"] = {"events_per_s": round(floor, 1), "ratio": round(eps["service"] / floor, 3),
                                          "over_raw_insert": round(floor / eps["raw_insert"], 3)}
            out[f"streams_{streams}"] = level
        return out

    async def lag_phase(self, loaded_events: int, n_paced: int) -> tuple[list[float], list[float]]:
        """Outbox lag in a phase of its own (the ctx.evt.> subscriber exists only here): under an 8-stream load of
        the lean generator, then paced, one append every 5 ms."""
        sub = await self.nc.subscribe(EVENTS_SUBJECTS, cb=self.lag.on_msg)
        await self.nc.flush()
        try:
            plans = [Appends(loaded_events // 8, 1) for _ in range(8)]

            async def appender(plan: Appends) -> None:
                for data, to_version, ids in plan.requests:
                    await self.lean_append(data, to_version)
                    self.lag.acked[ids[0]] = time.perf_counter()

            await asyncio.gather(*(appender(plan) for plan in plans))
            loaded = await self.lag.samples([i for plan in plans for i in plan.ids()])
            paced = Appends(n_paced, 1)
            for data, to_version, ids in paced.requests:
                await self.lean_append(data, to_version)
                self.lag.acked[ids[0]] = time.perf_counter()
                await asyncio.sleep(0.005)
            return loaded, await self.lag.samples(paced.ids()) if n_paced else []
        finally:
            await sub.unsubscribe()

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
        await self.relayed.wait_all(ids)
        n = len(ids)
        return {"streams": streams, "events": n, "events_per_s": round(n / wall, 1),
                "commits_per_event": round((after["xact_commit"] - before["xact_commit"]) / n, 3),
                "wal_bytes_per_event": round(float(wal) / n, 1),
                "note": "xact_commit counts every committed transaction of the database in the window: the appends, "
                        "the outbox relay's and the projector's, and the waits' own few reads"}


async def run(stack: Stack, args: argparse.Namespace) -> dict:
    b = Bench(stack)
    await b.open()
    responder = start_floor_responder(__file__, stack, "the floor responder (bare NATS, service floor)")
    main_pid = stack.procs["persistence"]["pid"]
    # the census: where the two cores go during each run (the bench's own process without its children: the stack
    # is its child processes)
    cpu = {"bench_client": CpuGroup([os.getpid()], children=False),
           "nats_server": CpuGroup([stack.procs["nats"]["pid"]]),
           "postgres": CpuGroup([stack.procs["postgres"]["pid"]]),
           "service": CpuGroup([main_pid]),
           "floor_responder": CpuGroup([responder.pid])}
    events = {1: args.events_1, 8: args.events_8, 32: args.events_32}
    result: dict = {"benchmark": "eventstore", "event_bytes": EVENT_BYTES}
    try:
        for i in range(50):  # warm-up: connections, prepared statements, the relay's stream, both load generators
            await b.rpc.call(APPEND_SUBJECT, b.request(f"bench:warm:{i % 5}", i // 5, i)[1])
        await b.service_run(5, 10, [])
        await b.raw_run(max(LEVELS), 5)
        await b.latency(100, 1)
        print("latency …", flush=True)
        lat = await b.latency(args.n_latency, args.rounds)
        # before the throughput runs (where the 8-stream level used to measure it) and again after them: the relay
        # after tens of thousands of rows need not be the relay of a fresh stack
        print("outbox lag …", flush=True)
        lag_loaded, lag_paced = await b.lag_phase(2 * args.events_8, args.n_paced)
        print("throughput, 1 replica …", flush=True)
        tp1 = await b.throughput(events, cpu, rpc_client=True)
        print("throughput, 1 replica, a step's events per append …", flush=True)
        tp1_batch = await b.throughput(events, cpu, batch=STEP_EVENTS, levels=(32,))
        lag_after, _ = await b.lag_phase(2 * args.events_8, 0)
        commits = await b.commits(32, max(1, args.events_32 // 32)) if args.commits else None
        print("throughput, 2 replicas …", flush=True)
        second = await asyncio.to_thread(lambda: Replica(stack, "persistence", "bench-persistence-2").wait_ready())
        try:
            await asyncio.sleep(1)  # its relay and projector settle (they poll)
            tp2 = await b.throughput(events, {**cpu, "service": CpuGroup([main_pid, second.proc.pid])})
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
        "throughput_ratio_32_streams_rpc_client": tp1["streams_32"]["rpc_client"]["ratio"],
        "throughput_ratio_32_streams_2_replicas": tp2["streams_32"]["ratio"],
        "throughput_ratio_32_streams_vs_relayed_floor": tp1["streams_32"]["relayed_floor"]["ratio"],
        # how far below raw INSERT any store that hands each committed event to JetStream stays, service or none
        "relayed_floor_over_raw_insert_32_streams": tp1["streams_32"]["relayed_floor"]["over_raw_insert"],
        "relayed_floor_partitioned_over_raw_insert_32_streams":
            tp1["streams_32"]["relayed_floor_partitioned"]["over_raw_insert"],
        "throughput_ratio_32_streams_vs_service_floor": tp1["streams_32"]["service_floor"]["ratio"],
        "service_floor_over_raw_insert_32_streams": tp1["streams_32"]["service_floor"]["over_raw_insert"],
        "throughput_ratio_32_streams_5_per_append": tp1_batch["streams_32"]["ratio"],
        "targets_hold": lat["append_ratio_vs_floor"] <= TARGET_APPEND_RATIO_VS_FLOOR
        and r32 >= TARGET_THROUGHPUT_RATIO_32,
        "append_ratio_vs_raw_insert": lat["append_ratio_vs_raw_insert"],
        "append": lat,
        "throughput": {"replicas_1": tp1, "replicas_2": tp2, "replicas_1_5_per_append": tp1_batch},
        "postgres_per_event": commits,
        "outbox_lag_ms": {"paced_5ms": lag_summary(lag_paced), "under_8_stream_load": lag_summary(lag_loaded),
                          "under_8_stream_load_after_throughput": lag_summary(lag_after)},
        "how": {
            "append_ratio_vs_floor": "p50 of one ctx.persist.append (1 event of 1 KB) round trip / (p50 of a bare "
                                     "nats-py request/reply of the same request bytes to a responder in its own "
                                     "process that answers a fixed reply + p50 of one autocommitted prepared "
                                     "asyncpg INSERT of the same row into a table of the same shape in the same "
                                     "database), all measured in the same interleaved rounds",
            "throughput_ratio_32_streams": "events/s of 32 concurrent appenders through the service (one stream "
                                           "each, one event per append, in order) / events/s of 32 asyncpg "
                                           "connections each running autocommitted INSERTs of the same rows; two "
                                           "runs each, order alternating, 1 persistence replica. The service side's "
                                           "load generator is lean like the raw side's: request bytes built and "
                                           "JSON-encoded before the timed run, nats-py request on a plain "
                                           "connection, each reply checked ({\"result\"} with the expected "
                                           "toVersion, else the bench fails); no subscriber to ctx.evt.> in the "
                                           "bench process during the run",
            "throughput_ratio_32_streams_rpc_client": "the same, the service side driven by the platform's "
                                                      "RpcClient (claim check, JSON encoding, a producer span per "
                                                      "request; each event built in the timed loop), measured in "
                                                      "the same rounds as the lean generator and raw INSERT",
            "throughput_ratio_32_streams_vs_relayed_floor": "the service's events/s at 32 streams (1 replica) / "
                                                            "the relayed floor's in the same rounds: 32 asyncpg "
                                                            "connections each INSERTing its rows (autocommit) and "
                                                            "publishing each committed row to a JetStream file "
                                                            "stream of the same server (sync always, Nats-Msg-Id), "
                                                            "pipelined, the run ending when every publish is acked "
                                                            "— the per-event work of committing an event and "
                                                            "handing it to JetStream, which the service's outbox "
                                                            "relay does and raw INSERT does not",
            "relayed_floor_over_raw_insert_32_streams": "the relayed floor's events/s / raw INSERT's, 32 connections, "
                                                        "same rounds: the most any store that hands every committed "
                                                        "event to a sync-always JetStream could reach of raw INSERT "
                                                        "here, with no service at all",
            "relayed_floor_partitioned_over_raw_insert_32_streams": "the same with the publishes spread over "
                                                                    f"{RELAYED_PARTITIONS} JetStream streams (the "
                                                                    "connections evenly): each stream stores and "
                                                                    "flushes its messages one at a time, so more "
                                                                    "streams let flushes overlap",
            "throughput_ratio_32_streams_vs_service_floor": "the service's events/s at 32 streams / the service "
                                                            "floor's in the same rounds: a bare nats-py responder in "
                                                            "its own process that INSERTs each event (prepared, "
                                                            "autocommit, a pooled connection), replies, then "
                                                            "publishes it to a JetStream file stream (pipelined; "
                                                            "every ack checked after the run), driven by the same "
                                                            "lean generator — no framework, validation, outbox, "
                                                            "group commit, idempotency or version check",
            "service_floor_over_raw_insert_32_streams": "the service floor's events/s / raw INSERT's, same rounds: "
                                                        "what throughput_ratio_32_streams would be for that bare "
                                                        "service",
            "throughput_ratio_32_streams_5_per_append": "the same with 5 events per append (a step's events, as the "
                                                        "runner appends them) beside raw transactions of 5 INSERTs "
                                                        "each (asyncpg executemany: pipelined, one commit)",
            "floors_exclude": "raw INSERT: no outbox row, no expected-version read, no lock, no idempotency check; "
                              "bare NATS: no FastStream, no validation, no tracing, no database",
            "cpu": "psutil user+system seconds over each run (cpu_s_per_1k_events, per side): the bench process "
                   "itself (without its children), nats-server, Postgres (postmaster, backends, reaped children), "
                   "the persistence process(es) and the floor responder (bare NATS, service floor); "
                   "cores_busy = their sum / wall time. Other work on the "
                   "shared machine is not in it",
            "outbox_lag": "in a phase of its own before the throughput runs (8 streams of the lean generator, "
                          "2 x --events-8 events, then paced) and the 8-stream load again after the 1-replica "
                          "throughput runs (under_8_stream_load_after_throughput): the only times the bench "
                          "subscribes to ctx.evt.>; that every event of the throughput runs reached JetStream is "
                          "checked after each level by reading CTX_EVENTS",
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
