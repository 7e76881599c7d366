"""Helpers of the persistence integration tests: ids, request events, ``ctx.persist.append``, waiting for a
condition and paging the global order."""

from __future__ import annotations

import asyncio
import time
import uuid


def new_id() -> str:
    return str(uuid.uuid4())


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


async def read_all_until(rpc, after: int, done: asyncio.Event, limit: int) -> tuple[list[int], list]:
    """Pages ``ctx.persist.read_all`` from position ``after`` while appends commit, until ``done`` is set and a page
    comes back empty. Returns the positions seen and the pages that did not continue the cursor exactly
    (``(cursor, positions)``: a consumer tracking its last position would have skipped an event)."""
    seen: list[int] = []
    gaps: list[tuple[int, list[int]]] = []
    cursor = after
    while True:
        finished = done.is_set()
        page = await rpc.call("ctx.persist.read_all", {"afterPosition": cursor, "limit": limit})
        positions = [x["position"] for x in page["events"]]
        if positions != list(range(cursor + 1, cursor + 1 + len(positions))):
            gaps.append((cursor, positions))
        seen.extend(positions)
        cursor = page["lastPosition"]
        if finished and not positions:
            return seen, gaps
        await asyncio.sleep(0)
