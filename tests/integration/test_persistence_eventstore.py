"""Event store semantics under concurrency, on the real service (NATS request/reply → Postgres): optimistic
concurrency (exactly one winner per version), idempotency by event id, a global order that a reader follows
without skipping or repeating an event — a transaction that commits late included —, and the trace context
carried by every event."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter

import pytest
from ctxbuild_platform.errors import RemoteError
from ctxbuild_platform.rpc import RpcClient

from tests.support.persistence import append, event, event_store, new_id, read_all_until, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def persistence(start_service) -> str:
    return start_service("persistence")


async def test_ten_appenders_at_the_same_version_exactly_one_wins_each_version(persistence, rpc):
    stream = f"test:{new_id()}"
    rounds, appenders = 8, 10
    winners: list[int] = []
    for version in range(rounds):
        attempts = [event("ThingHappened", {"round": version, "appender": a}) for a in range(appenders)]
        results = await asyncio.gather(*(append(rpc, stream, [ev], expected=version) for ev in attempts),
                                       return_exceptions=True)
        ok = [(a, r) for a, r in enumerate(results) if isinstance(r, dict)]
        conflicts = [r for r in results if isinstance(r, RemoteError)]
        assert len(ok) == 1, results
        assert len(conflicts) == appenders - 1 and all(c.code == "version-conflict" for c in conflicts)
        assert all(c.details["actualVersion"] == version + 1 for c in conflicts)  # the winner's version
        assert ok[0][1]["fromVersion"] == ok[0][1]["toVersion"] == version + 1
        winners.append(ok[0][0])
    got = await rpc.call("ctx.persist.read_stream", {"streamId": stream})
    assert [e["version"] for e in got["events"]] == list(range(1, rounds + 1))
    assert [e["data"]["appender"] for e in got["events"]] == winners
    assert [e["data"]["round"] for e in got["events"]] == list(range(rounds))


async def test_contending_writers_with_retries_never_lose_or_double_an_event(persistence, rpc):
    """Each writer reads the version, appends with it, and retries on a conflict (the runner's pattern)."""
    stream = f"test:{new_id()}"
    writers, per_writer = 10, 5
    conflicts = Counter()

    async def writer(w: int) -> list[int]:
        versions = []
        for k in range(per_writer):
            ev = event("ThingHappened", {"w": w, "k": k})
            while True:
                current = (await rpc.call("ctx.persist.read_stream", {"streamId": stream, "limit": 1}))["lastVersion"]
                try:
                    res = await append(rpc, stream, [ev], expected=current)
                except RemoteError as exc:
                    assert exc.code == "version-conflict"
                    conflicts[w] += 1
                    continue
                versions.append(res["fromVersion"])
                break
        return versions

    won = await asyncio.gather(*(writer(w) for w in range(writers)))
    all_versions = sorted(v for vs in won for v in vs)
    assert all_versions == list(range(1, writers * per_writer + 1))  # every version won exactly once
    got = await rpc.call("ctx.persist.read_stream", {"streamId": stream})
    assert sorted((e["data"]["w"], e["data"]["k"]) for e in got["events"]) == [
        (w, k) for w in range(writers) for k in range(per_writer)]
    assert sum(conflicts.values()) > 0  # there really was contention


async def test_duplicate_ids_under_concurrency_are_stored_once(persistence, rpc):
    stream = f"test:{new_id()}"
    batch = [event("ThingHappened", {"i": i}) for i in range(5)]
    # the same batch sent 10 times at once (a client retrying over a flaky link), plus a batch that repeats
    # an id inside itself
    results = await asyncio.gather(*(append(rpc, stream, batch, expected=0) for _ in range(10)),
                                   return_exceptions=True)
    ok = [r for r in results if isinstance(r, dict)]
    assert len(ok) == 10, results  # all succeed: the losers see only duplicates, so no version check applies
    assert sorted(r["duplicates"] for r in ok) == [0] + [5] * 9
    assert len({tuple(r["positions"]) for r in ok}) == 1
    inner = event("ThingHappened", {"i": "inner"})
    res = await append(rpc, stream, [inner, inner, batch[0]], expected=5)
    assert res["duplicates"] == 2 and res["positions"][0] == res["positions"][1]
    got = await rpc.call("ctx.persist.read_stream", {"streamId": stream})
    assert [e["data"]["i"] for e in got["events"]] == [0, 1, 2, 3, 4, "inner"]
    assert len({e["eventId"] for e in got["events"]}) == 6


async def test_readers_see_every_event_once_in_one_order_while_many_streams_append(persistence, rpc, stack):
    """Readers page through read_all while 40 writers append (no global lock: positions are taken and committed
    out of order): each reader sees every event exactly once, and all readers see the same order."""
    import asyncpg

    conn = await asyncpg.connect(stack.env["CTX_DATABASE_URL"])
    try:  # the last event of the log as it is now: the readers start after it
        head = await conn.fetchval("SELECT coalesce((SELECT position FROM persistence.events "
                                   "ORDER BY tx DESC, position DESC LIMIT 1), 0)")
    finally:
        await conn.close()
    done = asyncio.Event()

    async def writer(i: int) -> list[int]:
        out = []
        stream = f"test:{new_id()}"
        for k in range(5):
            out += (await append(rpc, stream, [event("ThingHappened", {"i": i, "k": k, "pad": "x" * 200})],
                                 expected=k))["positions"]
        return out

    written: list[list[int]] = []
    readers = [asyncio.create_task(read_all_until(rpc, head, done, limit=200,
                                                  expect=lambda: {p for ps in written for p in ps}))
               for _ in range(3)]
    written += await asyncio.gather(*(writer(i) for i in range(40)))
    done.set()
    pages = await asyncio.wait_for(asyncio.gather(*readers), 60)
    assert [r for _, repeats in pages for r in repeats] == []
    mine = {p for ps in written for p in ps}
    assert len(mine) == 200
    orders = [[p for p in seen if p in mine] for seen, _ in pages]
    assert all(set(o) == mine for o in orders)  # nobody skipped one
    assert orders[0] == orders[1] == orders[2]  # one order for everyone
    for ps in written:  # a stream's events in version order within the global order
        assert sorted(ps, key=orders[0].index) == ps


async def test_a_late_commit_is_not_skipped_and_holds_readers_back(persistence, rpc, stack):
    """A transaction takes a position, then commits after later appends have committed (a slow writer). A reader
    following the log never skips it: while it is open, the log stops before it (later commits wait behind it —
    the price of reading without a global write lock); once it commits, its event and everything after it come,
    each once."""
    import asyncpg

    url = stack.env["CTX_DATABASE_URL"]
    start = (await append(rpc, f"test:{new_id()}", [event("ThingHappened", {"start": True})]))["positions"][0]
    slow = await asyncpg.connect(url)
    late_stream, late_id = f"test:{new_id()}", uuid.uuid4()
    try:
        tx = slow.transaction()
        await tx.start()
        late = await slow.fetchval(
            "WITH ins AS (INSERT INTO persistence.events (stream_id, version, event_id, type, data) "
            "VALUES ($1, 1, $2, 'ThingHappened', '{\"late\":true}') RETURNING position) "
            "INSERT INTO persistence.outbox (position) SELECT position FROM ins RETURNING position",
            late_stream, late_id)
        after = [(await append(rpc, f"test:{new_id()}", [event("ThingHappened", {"k": k})]))["positions"][0]
                 for k in range(5)]
        assert min(after) > late  # committed before it, with higher positions
        held = await rpc.call("ctx.persist.read_all", {"afterPosition": start, "limit": 1000})
        assert held["events"] == [] and held["nextPosition"] == start and not held["more"]
        await tx.commit()
    finally:
        await slow.close()
    async def caught_up():  # at once, unless another transaction (the relay's, the projector's) is still open
        page = await rpc.call("ctx.persist.read_all", {"afterPosition": start, "limit": 1000})
        return page if {late, *after} <= {e["position"] for e in page["events"]} else None

    page = await wait_until(caught_up, timeout=15, what="the late event and the later ones readable")
    got = [e["position"] for e in page["events"]]
    assert got[:1] == [late] and set(after) <= set(got[1:]) and len(got) == len(set(got))
    rest = await rpc.call("ctx.persist.read_all", {"afterPosition": page["nextPosition"], "limit": 1000})
    assert not {e["position"] for e in rest["events"]} & set(got)  # nothing comes twice


async def test_the_trace_of_the_caller_is_stored_with_every_event(persistence, stack):
    """A span opened by a caller (e.g. the turn runner) continues over NATS into persistence; the stored event
    metadata carries that trace id, and the relay forwards it to JetStream as a header."""
    from faststream.nats import NatsBroker
    from faststream.nats.opentelemetry import NatsTelemetryMiddleware
    from nats.js.errors import NotFoundError
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider()
    broker = NatsBroker(stack.env["CTX_NATS_URL"], logger=None,
                        middlewares=[NatsTelemetryMiddleware(tracer_provider=provider)])
    await broker.connect()
    try:
        client = RpcClient(broker, default_timeout=30)
        type_ = f"Traced{uuid.uuid4().hex[:10]}"
        stream = f"turn:{new_id()}"
        with provider.get_tracer("test").start_as_current_span("turn") as span:
            trace_id = format(span.get_span_context().trace_id, "032x")
            res = await client.call("ctx.persist.append", {"streamId": stream, "expectedVersion": 0, "events": [
                event(type_, {"n": 1}), event(type_, {"n": 2}, metadata={"causationId": "req-1"})]})
        got = await client.call("ctx.persist.read_stream", {"streamId": stream})
        for ev in got["events"]:
            version, tid, parent_span, _flags = ev["metadata"]["traceparent"].split("-")
            assert tid == trace_id and version == "00" and len(parent_span) == 16
        assert got["events"][1]["metadata"]["causationId"] == "req-1"

        js = broker._connection.jetstream()
        # the relay pipelines a batch: the first event can be on JetStream before the second is; wait for the second
        for _ in range(100):
            try:
                msg = await js.get_last_msg("CTX_EVENTS", f"ctx.evt.{type_}")
                if json.loads(msg.data)["position"] == res["positions"][1]:
                    break
            except NotFoundError:
                pass
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the second event was not relayed")
        assert msg.headers["traceparent"].split("-")[1] == trace_id
    finally:
        await broker.stop()


async def test_grouped_appends_each_get_their_own_answer(stack):
    """Appends that arrive together are written in one statement; one of them repeating stored ids or expecting
    the wrong version must neither fail nor hold up the others, and each gets the answer it would get alone."""
    from ctxbuild_persistence.domain.append import NewEvent

    async with event_store(stack) as store:
        a, b, c, d = (f"test:{new_id()}" for _ in range(4))
        stored = [NewEvent(new_id(), "ThingHappened", {"k": k}) for k in range(2)]
        await store.append(b, 0, stored)
        await store.append(c, 0, [NewEvent(new_id(), "ThingHappened", {})])
        results = await asyncio.gather(
            store.append(a, 0, [NewEvent(new_id(), "ThingHappened", {"a": k}) for k in range(3)]),
            store.append(b, 0, stored),  # a retry of an acknowledged append
            store.append(c, 0, [NewEvent(new_id(), "ThingHappened", {})]),  # stale version
            store.append(d, None, [NewEvent(new_id(), "ThingHappened", {})]),
            store.append(a, 3, [NewEvent(new_id(), "ThingHappened", {"a": 3})]),  # the same stream: next group
            return_exceptions=True)
        ra, rb, rc, rd, ra2 = results
        assert (ra["fromVersion"], ra["toVersion"], ra["duplicates"]) == (1, 3, 0)
        assert rb["duplicates"] == 2 and (rb["fromVersion"], rb["toVersion"]) == (1, 2)
        assert isinstance(rc, Exception) and getattr(rc, "code", None) == "version-conflict", rc
        assert (rd["fromVersion"], rd["duplicates"]) == (1, 0)
        assert (ra2["fromVersion"], ra2["toVersion"]) == (4, 4)
        async with store.db.pool.acquire() as conn:
            versions = await conn.fetch("SELECT stream_id, count(*) AS n, max(version) AS v FROM persistence.events "
                                        "WHERE stream_id = ANY($1) GROUP BY stream_id", [a, b, c, d])
        assert {r["stream_id"]: (r["n"], r["v"]) for r in versions} == {a: (4, 4), b: (2, 2), c: (1, 1), d: (1, 1)}
