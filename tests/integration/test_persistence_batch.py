"""``ctx.persist.append_batch`` (several streams, one commit: all or nothing, each group by the single append's
rules) and ``ctx.persist.read_stream`` with ``last`` (a stream's last event in one read), on the real service
(NATS request/reply → Postgres)."""

from __future__ import annotations

import asyncio

import pytest
from ctxbuild_platform.errors import RemoteError

from tests.support.persistence import append, event, event_store, new_id, read_all_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def persistence(start_service) -> str:
    return start_service("persistence")


def group(stream: str, events: list[dict], expected: int | None = 0) -> dict:
    return {"streamId": stream, "expectedVersion": expected, "events": events}


async def batch(rpc, *groups: dict) -> dict:
    return await rpc.call("ctx.persist.append_batch", {"appends": list(groups)})


async def last_version(rpc, stream: str) -> int:
    return (await rpc.call("ctx.persist.read_stream", {"streamId": stream, "last": True}))["lastVersion"]


async def test_a_batch_is_one_commit_read_back_in_request_order(persistence, rpc):
    a, b, c = (f"test:{new_id()}" for _ in range(3))
    await append(rpc, c, [event("ThingHappened", {"k": 0})])
    mark = await append(rpc, f"test:{new_id()}", [event("ThingHappened", {})])
    groups = [group(a, [event("ThingHappened", {"g": 0, "k": k}) for k in range(3)]),
              group(b, [event("ThingHappened", {"g": 1, "k": 0})], expected=None),
              group(c, [event("ThingHappened", {"g": 2, "k": k}) for k in range(2)], expected=1)]
    res = await batch(rpc, *groups)
    ra, rb, rc = res["results"]
    assert (ra["streamId"], ra["fromVersion"], ra["toVersion"], ra["duplicates"]) == (a, 1, 3, 0)
    assert (rb["fromVersion"], rb["toVersion"]) == (1, 1)
    assert (rc["fromVersion"], rc["toVersion"]) == (2, 3)
    positions = ra["positions"] + rb["positions"] + rc["positions"]
    done = asyncio.Event()
    done.set()
    seen, repeats = await read_all_until(rpc, mark["positions"][0], done, limit=100, expect=lambda: positions)
    assert not repeats
    mine = [p for p in seen if p in set(positions)]
    assert mine == positions  # the batch's events in request order, group after group
    start = seen.index(positions[0])
    assert seen[start:start + len(positions)] == positions  # one transaction: nothing in between
    got = await rpc.call("ctx.persist.read_stream", {"streamId": c})
    assert [e["data"].get("g") for e in got["events"]] == [None, 2, 2]


async def test_a_version_conflict_in_group_two_stores_nothing_of_group_one(persistence, rpc):
    a, b = f"test:{new_id()}", f"test:{new_id()}"
    await append(rpc, b, [event("ThingHappened", {})])
    with pytest.raises(RemoteError) as err:
        await batch(rpc, group(a, [event("ThingHappened", {"k": k}) for k in range(2)]),
                    group(b, [event("ThingHappened", {})], expected=0))  # b is at 1
    assert err.value.code == "version-conflict"
    assert err.value.details["streamId"] == b and err.value.details["actualVersion"] == 1
    assert await last_version(rpc, a) == 0
    assert await last_version(rpc, b) == 1


async def test_an_event_id_stored_on_another_stream_refuses_the_whole_batch(persistence, rpc):
    a, b, other = (f"test:{new_id()}" for _ in range(3))
    taken = event("ThingHappened", {})
    await append(rpc, other, [taken])
    with pytest.raises(RemoteError) as err:
        await batch(rpc, group(a, [event("ThingHappened", {})]), group(b, [event("ThingHappened", {}), taken]))
    assert err.value.code == "event-id-conflict"
    assert await last_version(rpc, a) == 0 and await last_version(rpc, b) == 0


async def test_retrying_an_acknowledged_batch_is_a_no_op_success(persistence, rpc):
    a, b = f"test:{new_id()}", f"test:{new_id()}"
    groups = [group(a, [event("ThingHappened", {"k": k}) for k in range(2)]), group(b, [event("ThingHappened", {})])]
    first = await batch(rpc, *groups)
    again = await batch(rpc, *groups)  # expected versions now stale: every event is a duplicate, so no check
    assert [r["duplicates"] for r in again["results"]] == [2, 1]
    assert [r["positions"] for r in again["results"]] == [r["positions"] for r in first["results"]]
    assert await last_version(rpc, a) == 2 and await last_version(rpc, b) == 1
    # a group with new events on a stale version still conflicts, and the retried group beside it adds nothing
    with pytest.raises(RemoteError) as err:
        await batch(rpc, groups[0], group(b, [event("ThingHappened", {})], expected=0))
    assert err.value.code == "version-conflict"
    assert await last_version(rpc, b) == 1


async def test_a_refused_event_or_a_repeated_stream_is_invalid_and_stores_nothing(persistence, rpc):
    a, b = f"test:{new_id()}", f"test:{new_id()}"
    with pytest.raises(RemoteError) as err:
        await batch(rpc, group(a, [event("ThingHappened", {})]),
                    group(b, [event("ThingHappened", {"x": "y" * 70_000})]))  # over the 64 KiB event limit
    assert err.value.code == "invalid-payload" and err.value.details["groupIndex"] == 1
    with pytest.raises(RemoteError) as err:
        await batch(rpc, group(a, [event("ThingHappened", {})]), group(a, [event("ThingHappened", {})], None))
    assert err.value.code == "invalid-payload" and err.value.details["streamId"] == a
    assert await last_version(rpc, a) == 0 and await last_version(rpc, b) == 0


async def test_a_batch_over_the_inline_limit_goes_by_claim(persistence, rpc):
    """No ceiling (SPEC §15.1): ~2.4 MB of events in 8 groups travel as a claim and are stored in one commit."""
    streams = [f"test:{new_id()}" for _ in range(8)]
    groups = [group(s, [event("ThingHappened", {"blob": f"{g}-{k}-" + "z" * 60_000}) for k in range(5)])
              for g, s in enumerate(streams)]
    res = await batch(rpc, *groups)
    assert [(r["fromVersion"], r["toVersion"]) for r in res["results"]] == [(1, 5)] * 8
    got = await rpc.call("ctx.persist.read_stream", {"streamId": streams[7], "last": True})
    assert got["events"][0]["data"]["blob"].startswith("7-4-")


async def test_batches_and_single_appends_written_together_each_get_their_own_answer(stack):
    """Requests that arrive together share one statement; a batch whose second part expects a stale version must
    write none of its parts, and must not fail nor hold up the appends grouped with it."""
    from ctxbuild_persistence.adapters.event_store import AppendPart
    from ctxbuild_persistence.domain.append import NewEvent

    async with event_store(stack) as store:
        a, b, c, d, e = (f"test:{new_id()}" for _ in range(5))
        await store.append(d, 0, [NewEvent(new_id(), "ThingHappened", {})])

        def evs(n: int) -> list[NewEvent]:
            return [NewEvent(new_id(), "ThingHappened", {"k": k}) for k in range(n)]

        results = await asyncio.gather(
            store.append_batch([AppendPart(a, 0, evs(2)), AppendPart(b, 0, evs(1))]),
            store.append_batch([AppendPart(c, 0, evs(1)), AppendPart(d, 0, evs(1))]),  # d is at 1: nothing stored
            store.append(e, None, evs(3)),
            store.append_batch([AppendPart(a, 2, evs(1)), AppendPart(e, 3, evs(1))]),  # the same streams: next group
            return_exceptions=True)
        rab, rcd, re, rae = results
        assert [(r["fromVersion"], r["toVersion"]) for r in rab] == [(1, 2), (1, 1)]
        assert getattr(rcd, "code", None) == "version-conflict", rcd
        assert (re["fromVersion"], re["toVersion"]) == (1, 3)
        assert [(r["fromVersion"], r["toVersion"]) for r in rae] == [(3, 3), (4, 4)]
        async with store.db.pool.acquire() as conn:
            rows = await conn.fetch("SELECT stream_id, count(*) AS n FROM persistence.events "
                                    "WHERE stream_id = ANY($1) GROUP BY stream_id", [a, b, c, d, e])
        assert {r["stream_id"]: r["n"] for r in rows} == {a: 3, b: 1, d: 1, e: 4}


async def test_read_stream_last_is_the_tail_in_one_read(persistence, rpc):
    s = f"test:{new_id()}"
    empty = await rpc.call("ctx.persist.read_stream", {"streamId": s, "last": True})
    assert (empty["events"], empty["lastVersion"], empty["more"]) == ([], 0, False)
    await append(rpc, s, [event("ThingHappened", {"k": k}) for k in range(3)])
    tail = await rpc.call("ctx.persist.read_stream", {"streamId": s, "last": True, "fromVersion": 1})
    assert [e["data"]["k"] for e in tail["events"]] == [2]
    assert (tail["lastVersion"], tail["nextVersion"], tail["more"]) == (3, 4, False)
