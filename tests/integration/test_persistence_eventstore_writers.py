"""The event store's concurrent group writers (``EventStore(writers=K)``, ``CTX_APPEND_WRITERS``), on the stack's
Postgres: groups on disjoint streams are written at once while a request on a stream already in flight waits for
a later group; a group goes beside another only once enough has queued; many concurrent appends over shared and
own streams keep every stream's versions 1..n and the global log gap-free; a failing group fails only its own
waiters; closing the store answers every waiter.

A group is held in flight by a test transaction that has inserted, uncommitted, the row the group is about to
insert (same stream and version): the group's statement waits on that key until the test rolls back."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
import pytest
from ctxbuild_platform.errors import ServiceError

from tests.support.persistence import new_id

pytestmark = pytest.mark.integration

WRITERS = 3


@asynccontextmanager
async def store_with_writers(stack, writers: int = WRITERS, concurrent_min: int = 1) -> AsyncIterator:
    from ctxbuild_persistence.adapters.db import Database, migrate
    from ctxbuild_persistence.adapters.event_store import EventStore

    url = stack.env["CTX_DATABASE_URL"]
    await asyncio.to_thread(migrate, url)
    db = Database(url, min_size=1, max_size=writers + 3)
    await db.connect()
    store = EventStore(db, writers=writers, concurrent_min=concurrent_min)
    try:
        yield store
    finally:
        await store.close()
        await db.close()


def ev(**data):
    from ctxbuild_persistence.domain.append import NewEvent

    return NewEvent(new_id(), "ThingHappened", data)


class Hold:
    """A transaction that has inserted version 1 of each stream and stays open: an append's first event on one
    of them waits in Postgres until :meth:`release` (a rollback)."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn
        self.tx = conn.transaction()

    async def release(self) -> None:
        if self.tx is not None:
            tx, self.tx = self.tx, None
            await tx.rollback()


@asynccontextmanager
async def holding(stack, *streams: str) -> AsyncIterator[Hold]:
    hold = Hold(await asyncpg.connect(stack.env["CTX_DATABASE_URL"]))
    try:
        await hold.tx.start()
        for s in streams:
            await hold.conn.execute("INSERT INTO persistence.events (stream_id, version, event_id, type, data) "
                                    "VALUES ($1, 1, $2, 'Blocker', '{}')", s, uuid.uuid4())
        yield hold
    finally:
        await hold.release()
        await hold.conn.close()


async def waiting_on(conn: asyncpg.Connection, hold: Hold) -> int:
    """How many sessions wait for a lock the hold's transaction has."""
    return await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                               hold.conn.get_server_pid())


async def until_waiting(conn: asyncpg.Connection, blocker: Hold, n: int) -> None:
    for _ in range(3000):  # a hang guard, not a speed check
        if await waiting_on(conn, blocker) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{n} statement(s) never reached the held row")


async def test_a_request_on_a_stream_in_flight_waits_while_other_streams_are_written(stack, pg):
    """Group 1 (stream a) is held in Postgres. A second request on a waits in the store — it never reaches
    Postgres while group 1 is in flight (it would read the version before group 1's write) — while requests on
    other streams, a batch among them, are written in groups of their own meanwhile. Once a's row is free, a gets
    versions 1 and 2 in arrival order."""
    a, b, c, d = (f"test:{new_id()}" for _ in range(4))
    from ctxbuild_persistence.adapters.event_store import AppendPart

    async with store_with_writers(stack) as store, holding(stack, a) as blocker:
        first = asyncio.create_task(store.append(a, None, [ev(n=1)]))
        await until_waiting(pg, blocker, 1)
        second = asyncio.create_task(store.append(a, None, [ev(n=2)]))
        batch = await asyncio.wait_for(store.append_batch([AppendPart(b, 0, [ev()]), AppendPart(c, 0, [ev()])]), 30)
        alone = await asyncio.wait_for(store.append(d, 0, [ev()]), 30)
        assert [r["toVersion"] for r in batch] == [1, 1] and alone["toVersion"] == 1
        assert await waiting_on(pg, blocker) == 1  # group 1 only: the second request on a was not sent
        assert not first.done() and not second.done()
        await blocker.release()
        r1, r2 = await asyncio.wait_for(asyncio.gather(first, second), 30)
    assert (r1["fromVersion"], r2["fromVersion"]) == (1, 2)
    rows = await pg.fetch("SELECT version, data->>'n' AS n FROM persistence.events WHERE stream_id = $1 "
                          "ORDER BY version", a)
    assert [(r["version"], r["n"]) for r in rows] == [(1, "1"), (2, "2")]


async def test_a_second_group_starts_only_once_enough_has_queued(stack, pg):
    """With ``concurrent_min`` 4: while a group is held in Postgres, 3 requests on other streams wait for it (small
    groups beside others cost a commit each); a 4th makes them a group of their own, written at once."""
    a = f"test:{new_id()}"
    others = [f"test:{new_id()}" for _ in range(4)]
    async with store_with_writers(stack, writers=2, concurrent_min=4) as store, holding(stack, a) as blocker:
        held = asyncio.create_task(store.append(a, None, [ev()]))
        await until_waiting(pg, blocker, 1)
        first = [asyncio.create_task(store.append(s, 0, [ev()])) for s in others[:3]]
        await asyncio.sleep(0)  # they have reached the store
        last = store.append(others[3], 0, [ev()])
        done = await asyncio.wait_for(asyncio.gather(*first, last), 30)
        assert [r["toVersion"] for r in done] == [1, 1, 1, 1] and not held.done()
        await blocker.release()
        assert (await asyncio.wait_for(held, 30))["toVersion"] == 1
    # one group, one transaction: none of the first three went alone beside the held group
    assert await pg.fetchval("SELECT count(DISTINCT tx) FROM persistence.events WHERE stream_id = ANY($1)",
                             others) == 1


async def test_a_failing_group_fails_only_its_own_waiters(stack, pg):
    """Three groups at once: one held in Postgres, one whose statement fails (data that is not JSON), one that
    expects a stale version. Each waiter gets its own answer; a request queued behind the held group is written."""
    a, b, c, e = (f"test:{new_id()}" for _ in range(4))
    from ctxbuild_persistence.domain.append import NewEvent

    async with store_with_writers(stack) as store:
        await store.append(c, 0, [ev()])
        async with holding(stack, a) as blocker:
            held = asyncio.create_task(store.append(a, 0, [ev()]))
            await until_waiting(pg, blocker, 1)
            bad = store.append(b, 0, [NewEvent(new_id(), "ThingHappened", {}, data_json="{not json")])
            stale = store.append(c, 0, [ev()])
            queued = asyncio.create_task(store.append(a, None, [ev()]))
            got_bad, got_stale = await asyncio.wait_for(asyncio.gather(bad, stale, return_exceptions=True), 30)
            assert getattr(got_bad, "code", None) == "invalid-payload", got_bad
            assert getattr(got_stale, "code", None) == "version-conflict", got_stale
            assert not held.done() and not queued.done()
            # and the writers of the two groups that failed write the next one
            assert (await asyncio.wait_for(store.append(e, 0, [ev()]), 30))["toVersion"] == 1
            await blocker.release()
            r_held, r_queued = await asyncio.wait_for(asyncio.gather(held, queued), 30)
    assert (r_held["toVersion"], r_queued["toVersion"]) == (1, 2)
    counts = dict(await pg.fetch("SELECT stream_id, count(*) FROM persistence.events WHERE stream_id = ANY($1) "
                                 "GROUP BY stream_id", [a, b, c, e]))
    assert counts == {a: 2, c: 1, e: 1}


async def test_closing_the_store_answers_every_waiter(stack, pg):
    """Two groups held in Postgres and a request queued behind one of them: closing the store gives each a
    retryable ``unavailable``, and an append after the close gets one at once."""
    a, b = (f"test:{new_id()}" for _ in range(2))
    async with store_with_writers(stack) as store, holding(stack, a, b) as blocker:
        in_flight = [asyncio.create_task(store.append(s, None, [ev()])) for s in (a, b)]
        await until_waiting(pg, blocker, 2)
        queued = asyncio.create_task(store.append(a, None, [ev()]))
        await asyncio.sleep(0)  # the queued one has reached the store
        await asyncio.wait_for(store.close(), 30)
        answers = await asyncio.wait_for(asyncio.gather(*in_flight, queued, return_exceptions=True), 30)
        assert all(isinstance(x, ServiceError) and x.code == "unavailable" and x.retryable for x in answers), answers
        with pytest.raises(ServiceError) as late:
            await store.append(f"test:{new_id()}", None, [ev()])
        assert late.value.code == "unavailable"


async def test_many_concurrent_appends_over_shared_and_own_streams(stack, pg):
    """40 appenders, each appending 8 times — to one of 4 shared streams, to its own stream, or as a batch over a
    shared stream and its own — with any version, while readers page the global log. Every acknowledged event is
    stored once at the version and position it was acknowledged with; every stream's versions are 1..n; each
    reader sees every event once, all in one order, each stream's events in version order."""
    from ctxbuild_persistence.adapters.event_store import AppendPart

    shared = [f"test:{new_id()}" for _ in range(4)]
    head = await pg.fetchval("SELECT coalesce((SELECT position FROM persistence.events "
                             "ORDER BY tx DESC, position DESC LIMIT 1), 0)")
    acked: dict[str, tuple[str, int, int]] = {}  # event id → (stream, version, position)

    async with store_with_writers(stack, writers=4) as store:
        done = asyncio.Event()

        async def appender(i: int) -> None:
            rng = random.Random(i)
            own = f"test:{new_id()}"
            for k in range(8):
                pick = rng.random()
                if pick < 0.6:
                    parts = [AppendPart(rng.choice(shared), None, [ev(i=i, k=k) for _ in range(rng.randint(1, 3))])]
                elif pick < 0.8:
                    parts = [AppendPart(own, None, [ev(i=i, k=k)])]
                else:
                    parts = [AppendPart(rng.choice(shared), None, [ev(i=i, k=k)]), AppendPart(own, None, [ev()])]
                for part, result in zip(parts, await store.append_batch(parts), strict=True):
                    assert result["duplicates"] == 0
                    for e, pos, v in zip(part.events, result["positions"],
                                         range(result["fromVersion"], result["toVersion"] + 1), strict=True):
                        acked[e.event_id] = (part.stream_id, v, pos)

        async def reader() -> list[int]:
            seen, cursor = [], head
            while True:
                finished = done.is_set()
                page = await store.read_all(cursor, 100, 1 << 20)
                seen += [x["position"] for x in page["events"]]
                cursor = page["nextPosition"]
                if finished and not page["events"] and {p for _, _, p in acked.values()} <= set(seen):
                    return seen
                await asyncio.sleep(0 if page["events"] else 0.01)

        readers = [asyncio.create_task(reader()) for _ in range(2)]
        await asyncio.gather(*(appender(i) for i in range(40)))
        done.set()
        orders = await asyncio.wait_for(asyncio.gather(*readers), 60)

    rows = await pg.fetch("SELECT event_id::text, stream_id, version, position FROM persistence.events "
                          "WHERE stream_id = ANY($1)", list({s for s, _, _ in acked.values()}))
    stored = {r["event_id"]: (r["stream_id"], r["version"], r["position"]) for r in rows}
    assert stored == acked  # each acknowledged event once, where it was acknowledged; nothing else
    per_stream = Counter(s for s, _, _ in acked.values())
    for s, n in per_stream.items():
        assert sorted(v for t, v, _ in acked.values() if t == s) == list(range(1, n + 1)), s
    mine = {p for _, _, p in acked.values()}
    logs = [[p for p in seen if p in mine] for seen in orders]
    assert all(len(log) == len(set(log)) == len(mine) for log in logs)  # nothing skipped, nothing twice
    assert logs[0] == logs[1]
    version_at = {p: (s, v) for s, v, p in acked.values()}
    for s in per_stream:
        assert [version_at[p][1] for p in logs[0] if version_at[p][0] == s] == list(range(1, per_stream[s] + 1))
