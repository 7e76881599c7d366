"""SSE streams read a turn's events when an append is announced (``ctx.turn.appended.<turnId>``), not on a timer:
an append through ``Backends.append`` to ``turn:<id>`` wakes the feed of that turn and no other, and the feed still
hands over live text deltas in arrival order."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import defaultdict
from types import SimpleNamespace

import nats
import pytest
from ctxbuild_orchestration.adapters.backends import Backends, new_event
from ctxbuild_orchestration.adapters.deltas import TurnFeed
from ctxbuild_orchestration.adapters.turn_watch import TurnWatch, publish_ended

pytestmark = pytest.mark.integration


def abort_requested(turn_id: str) -> dict:
    return new_event("TurnAbortRequested", {"turnId": turn_id, "reason": "test"})


@pytest.fixture(scope="module")
def persistence(start_service) -> str:
    return start_service("persistence")


async def test_an_append_to_a_turn_wakes_its_feed_and_no_other(persistence, rpc, stack):
    nc = await nats.connect(stack.env["CTX_NATS_URL"], name="wakeup-test")
    mine, other = f"t-{uuid.uuid4().hex}", f"t-{uuid.uuid4().hex}"
    feed, bystander = TurnFeed(), TurnFeed()
    try:
        await feed.subscribe(nc, mine)
        await bystander.subscribe(nc, other)
        await nc.flush()
        reply = await Backends(rpc).append(f"turn:{mine}", [abort_requested(mine)])
        await asyncio.wait_for(feed.stored.wait(), timeout=10)
        assert await feed.next_delta(5.0) is None  # an announced append ends the wait for deltas at once
        assert not bystander.stored.is_set()
        assert reply["toVersion"] == 1
        # an append to a stream that is not a turn announces nothing
        await Backends(rpc).append(f"other:{other}", [abort_requested(other)])
        await nc.flush()
        assert not bystander.stored.is_set()
        # one commit over several streams announces each turn stream in it
        feed.stored.clear()
        results = await Backends(rpc).append_streams([(f"elsewhere:{mine}", [abort_requested(mine)], None),
                                                      (f"turn:{mine}", [abort_requested(mine)], 1)])
        await asyncio.wait_for(feed.stored.wait(), timeout=10)
        assert results[1]["toVersion"] == 2
        assert not bystander.stored.is_set()
    finally:
        await feed.close()
        await bystander.close()
        await nc.drain()


async def test_the_append_that_creates_a_turn_stream_announces_nothing(persistence, rpc, stack):
    # nobody can follow a turn before its stream exists (the edge's admission creates it and only then answers with
    # its id): the creating append (expected version 0) sends no notice; the next one does
    nc = await nats.connect(stack.env["CTX_NATS_URL"], name="wakeup-create")
    turn = f"t-{uuid.uuid4().hex}"
    notices: list[int] = []
    arrived: defaultdict[int, asyncio.Event] = defaultdict(asyncio.Event)  # by toVersion

    async def on_notice(msg) -> None:
        notices.append(json.loads(msg.data)["toVersion"])
        arrived[notices[-1]].set()

    try:
        await nc.subscribe(f"ctx.turn.appended.{turn}", cb=on_notice)
        await nc.flush()
        backends = Backends(rpc)
        created = await backends.append_streams([(f"turn:{turn}", [abort_requested(turn)], 0)])
        assert created[0]["toVersion"] == 1
        await backends.append(f"turn:{turn}", [abort_requested(turn)], expected=1)
        # one publisher connection: a notice for version 1 would have arrived before the one for version 2
        await asyncio.wait_for(arrived[2].wait(), timeout=10)
        assert notices == [2]
        other = f"t-{uuid.uuid4().hex}"
        await nc.subscribe(f"ctx.turn.appended.{other}", cb=on_notice)
        await nc.flush()
        await backends.append(f"turn:{other}", [abort_requested(other)], expected=0)
        await backends.append(f"turn:{turn}", [abort_requested(turn)], expected=2)
        await asyncio.wait_for(arrived[3].wait(), timeout=10)
        assert notices == [2, 3]  # the single append that created `other` announced nothing either
    finally:
        await nc.drain()


async def test_the_feed_hands_over_deltas_in_order_and_drops_malformed_ones(stack):
    nc = await nats.connect(stack.env["CTX_NATS_URL"], name="wakeup-deltas")
    turn = f"t-{uuid.uuid4().hex}"
    feed = TurnFeed()
    try:
        await feed.subscribe(nc, turn)
        await nc.flush()
        deltas = [json.dumps({"turnId": turn, "step": 1, "seq": i, "text": f"part {i}"}).encode() for i in range(3)]
        await nc.publish(f"ctx.turn.delta.{turn}", deltas[0])
        await nc.publish(f"ctx.turn.delta.{turn}", b'{"not": "a delta"}')
        for d in deltas[1:]:
            await nc.publish(f"ctx.turn.delta.{turn}", d)
        await nc.flush()
        got = [await feed.next_delta(10.0) for _ in deltas]
        assert got == deltas
        assert not feed.stored.is_set()
    finally:
        await feed.close()
        await nc.drain()


async def test_a_feed_without_deltas_only_wakes(stack):
    nc = await nats.connect(stack.env["CTX_NATS_URL"], name="wakeup-nodeltas")
    turn = f"t-{uuid.uuid4().hex}"
    feed = TurnFeed(deltas=False)
    try:
        await feed.subscribe(nc, turn)
        await nc.flush()
        await nc.publish(f"ctx.turn.delta.{turn}", json.dumps({"turnId": turn, "step": 1, "seq": 0,
                                                               "text": "x"}).encode())
        await nc.publish(f"ctx.turn.ended.{turn}", json.dumps({"turnId": turn, "type": "TurnCompleted"}).encode())
        await asyncio.wait_for(feed.stored.wait(), timeout=10)
        assert feed.live.empty()
    finally:
        await feed.close()
        await nc.drain()


async def test_a_watch_for_one_whole_answer_takes_only_the_end_notice(stack):
    # a non-streamed gateway request waits for the end alone: deltas and append notices are not even delivered
    nc = await nats.connect(stack.env["CTX_NATS_URL"], name="wakeup-endonly")
    turn = f"t-{uuid.uuid4().hex}"
    whole, live = TurnWatch(deltas=False), TurnWatch()
    try:
        await whole.subscribe(nc, turn)
        await live.subscribe(nc, turn)
        await nc.flush()
        await nc.publish(f"ctx.turn.delta.{turn}", json.dumps({"turnId": turn, "step": 1, "seq": 0,
                                                               "text": "x"}).encode())
        await nc.publish(f"ctx.turn.appended.{turn}", json.dumps({"turnId": turn, "toVersion": 2}).encode())
        await publish_ended(SimpleNamespace(connection=nc), turn, "TurnCompleted")  # a broker's connection
        assert await asyncio.wait_for(live.items.get(), 10) == ("delta", {"step": 1, "seq": 0, "text": "x"})
        assert (await asyncio.wait_for(live.items.get(), 10))[0] == "ended"
        assert (await asyncio.wait_for(whole.items.get(), 10)) == ("ended", {"turnId": turn, "type": "TurnCompleted"})
        assert whole._sub.delivered == 1  # nats-py's count: the delta and the append notice never reached it
    finally:
        await whole.close()
        await live.close()
        await nc.drain()

