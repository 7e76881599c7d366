"""Reads paged by bytes (SPEC §15.1) against the real persistence service, Postgres and NATS: a stream far larger
than one NATS message reads back whole through pages that each stay under the budget; history pages too, and a
turn start reads only the window from the deepest compaction boundary."""

from __future__ import annotations

import json
import uuid

import pytest
from ctxbuild_platform.errors import RemoteError

pytestmark = pytest.mark.integration

BUDGET = 256 * 1024
BIG_EVENT_CHARS = 60_000  # under the 64 KiB event limit


@pytest.fixture(scope="module")
def persistence(start_service) -> str:
    return start_service("persistence")


def new_id() -> str:
    return str(uuid.uuid4())


def event(type_: str, data: dict) -> dict:
    return {"eventId": new_id(), "type": type_, "data": data}


def wire_size(reply: dict) -> int:
    return len(json.dumps(reply, ensure_ascii=False, separators=(",", ":")).encode())


async def append(rpc, stream: str, events: list[dict], expected: int | None = None) -> dict:
    return await rpc.call("ctx.persist.append", {"streamId": stream, "expectedVersion": expected, "events": events})


async def fill_stream(rpc, stream: str, count: int) -> list[str]:
    ids = []
    for i in range(0, count, 10):
        batch = [event("Bulky", {"i": i + j, "text": f"{i + j:06d}" + "x" * BIG_EVENT_CHARS}) for j in range(10)]
        await append(rpc, stream, batch)
        ids += [e["eventId"] for e in batch]
    return ids


async def test_stream_over_5mb_reads_back_through_pages(persistence, rpc):
    stream = f"test:{new_id()}"
    ids = await fill_stream(rpc, stream, 100)  # ≈ 6 MB of events
    got, nxt, pages = [], 1, 0
    while True:
        page = await rpc.call("ctx.persist.read_stream", {"streamId": stream, "fromVersion": nxt})
        pages += 1
        assert page["events"], page
        assert wire_size(page) < BUDGET + 4096  # the events fit the default budget; the rest is the envelope
        got += page["events"]
        assert page["nextVersion"] == page["events"][-1]["version"] + 1
        if not page["more"]:
            break
        nxt = page["nextVersion"]
    assert [e["eventId"] for e in got] == ids and [e["version"] for e in got] == list(range(1, 101))
    assert got[57]["data"]["text"].startswith("000057") and pages >= 20
    assert page["lastVersion"] == 100

    small = await rpc.call("ctx.persist.read_stream", {"streamId": stream, "fromVersion": 3, "maxBytes": 1024})
    assert [e["version"] for e in small["events"]] == [3]  # one whole event even when it is over the budget
    assert small["more"] and small["nextVersion"] == 4
    counted = await rpc.call("ctx.persist.read_stream", {"streamId": stream, "limit": 2, "maxBytes": 1 << 20})
    assert [e["version"] for e in counted["events"]] == [1, 2] and counted["more"]
    tail = await rpc.call("ctx.persist.read_stream", {"streamId": stream, "fromVersion": 101})
    assert tail["events"] == [] and not tail["more"] and tail["nextVersion"] == 101


async def test_read_all_pages_by_bytes(persistence, rpc):
    start = (await rpc.call("ctx.persist.read_all", {"afterPosition": 0, "limit": 1}))
    head = start["lastPosition"]
    # the log's current head: page with tiny budgets from a known position instead of scanning everything
    while True:
        page = await rpc.call("ctx.persist.read_all", {"afterPosition": head, "limit": 10_000})
        head = page["nextPosition"]
        if not page["more"]:
            break
    stream = f"test:{new_id()}"
    ids = await fill_stream(rpc, stream, 90)  # ≈ 5.4 MB
    mine, cursor = [], head
    while True:
        page = await rpc.call("ctx.persist.read_all", {"afterPosition": cursor, "maxBytes": 200_000})
        assert page["events"] and wire_size(page) < 200_000 + 4096
        mine += [e["eventId"] for e in page["events"] if e["streamId"] == stream]
        assert page["nextPosition"] == page["events"][-1]["position"] > cursor
        cursor = page["nextPosition"]
        if not page["more"]:
            break
    assert mine == ids
    done = await rpc.call("ctx.persist.read_all", {"afterPosition": cursor})
    assert done["events"] == [] and not done["more"] and done["nextPosition"] == cursor


async def test_oversized_event_is_a_typed_refusal(persistence, rpc):
    stream = f"test:{new_id()}"
    with pytest.raises(RemoteError) as err:
        await append(rpc, stream, [event("Bulky", {"text": "y" * 70_000})])
    assert err.value.code == "invalid-payload" and "65536" in err.value.message
    assert (await rpc.call("ctx.persist.read_stream", {"streamId": stream}))["lastVersion"] == 0
