"""Helpers of the persistence integration tests: ids, request events, ``ctx.persist.append``, waiting for a
condition, waiting for the projection and reading it, and paging the global order."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from typing import Any


def new_id() -> str:
    return str(uuid.uuid4())


async def projected(stack, cid: str, timeout: float = 30.0) -> None:
    """Until the projection has the conversation's last event (the log's order is (tx, position))."""
    import asyncpg

    conn = await asyncpg.connect(stack.env["CTX_DATABASE_URL"])
    try:
        deadline = time.monotonic() + timeout
        while not await conn.fetchval(
                "SELECT (c.tx, c.position) >= (e.tx, e.position) FROM persistence.projection_tracking t "
                "JOIN persistence.events c ON c.position = t.position, (SELECT tx, position FROM persistence.events "
                "WHERE stream_id = $1 ORDER BY version DESC LIMIT 1) e WHERE t.name = 'conversation'",
                f"conversation:{cid}"):
            assert time.monotonic() < deadline, f"the projection never reached conversation {cid}"
            await asyncio.sleep(0.05)
    finally:
        await conn.close()


async def projection_history(stack, cid: str, **request: Any) -> dict:
    """``ctx.persist.history`` as a replica that never folds a short conversation answers it (the service folds one
    this short): persistence's History in this process on the stack's database, with a projector of its own that
    never moves — call it once the projection has the conversation (:func:`projected`)."""
    from ctxbuild_codec.contract_models import dump
    from ctxbuild_codec.models.subjects.ctx_persist_history_request import PersistHistoryRequest
    from ctxbuild_persistence.adapters.projection import Projector
    from ctxbuild_persistence.app.history import History
    from ctxbuild_persistence.settings import Settings

    async with event_store(stack) as store:
        settings = Settings(database_url=stack.env["CTX_DATABASE_URL"], nats_url=stack.env["CTX_NATS_URL"],
                            history_fold_max_events=0)
        reply = await History(store, settings, Projector(store.db)).read(
            PersistHistoryRequest(conversationId=cid, **request))
    return dump(reply)


@asynccontextmanager
async def event_store(stack) -> AsyncIterator[Any]:
    """Persistence's own ``EventStore`` in the test process, on the stack's database (migrated)."""
    from ctxbuild_persistence.adapters.db import Database, migrate
    from ctxbuild_persistence.adapters.event_store import EventStore

    url = stack.env["CTX_DATABASE_URL"]
    await asyncio.to_thread(migrate, url)
    db = Database(url, min_size=1, max_size=4)
    await db.connect()
    try:
        yield EventStore(db)
    finally:
        await db.close()


def event(type_: str, data: dict, **extra) -> dict:
    return {"eventId": new_id(), "type": type_, "data": data, **extra}


async def append(rpc, stream: str, events: list[dict], expected: int | None = None) -> dict:
    return await rpc.call("ctx.persist.append", {"streamId": stream, "expectedVersion": expected, "events": events})


async def wait_until(predicate, timeout: float = 15.0, what: str = "condition", interval: float = 0.1):
    """The first truthy value of ``await predicate()``, polled every ``interval`` s; AssertionError after
    ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached in {timeout}s")
        await asyncio.sleep(interval)


async def read_all_until(rpc, after: int, done: asyncio.Event, limit: int,
                         expect: Callable[[], Collection[int]] = frozenset, patience_s: float = 30.0,
                         ) -> tuple[list[int], list[int]]:
    """Pages ``ctx.persist.read_all`` from the event at position ``after`` while appends commit, until ``done`` is
    set and a page comes back empty — and every position of ``expect()`` was seen, or ``patience_s`` passed since
    ``done`` (the log stops before a transaction still running, e.g. the relay's: an empty page is not the end).
    Returns the positions in the order seen and those seen more than once (a consumer following ``nextPosition``
    must see each event once; positions need not increase along the log)."""
    seen: list[int] = []
    deadline: float | None = None
    known: set[int] = set()
    repeats: list[int] = []
    cursor = after
    while True:
        finished = done.is_set()
        page = await rpc.call("ctx.persist.read_all", {"afterPosition": cursor, "limit": limit})
        positions = [x["position"] for x in page["events"]]
        repeats += [p for p in positions if p in known]
        known.update(positions)
        seen.extend(positions)
        assert page["nextPosition"] == (positions[-1] if positions else cursor)
        cursor = page["nextPosition"]
        if finished and deadline is None:
            deadline = time.monotonic() + patience_s
        if finished and not positions and (known >= set(expect()) or time.monotonic() > deadline):
            return seen, repeats
        await asyncio.sleep(0 if positions else 0.01)
