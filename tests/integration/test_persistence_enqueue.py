"""``ctx.persist.append_batch`` with ``enqueue``: the message goes to JetStream right after the batch's commit (a
turn's work-queue command), never for a refused batch, only under the configured subject prefix; a retried batch
publishes again and JetStream drops the repeat by its msgId. Real service, NATS JetStream and Postgres."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from ctxbuild_orchestration.adapters.backends import Backends, new_event
from ctxbuild_orchestration.adapters.work_queue import QueueConfig, TurnQueue
from ctxbuild_platform.errors import RemoteError
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig

from tests.support.persistence import append, event, new_id

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def persistence(start_service) -> str:
    return start_service("persistence")


@pytest.fixture
async def work_queue(nats_broker):
    """A work-queue stream of its own under the service's default prefix (ctx.turn.run), and a pull consumer."""
    tag = uuid.uuid4().hex[:10]
    name, subject = f"CTX_TURNS_ENQ_{tag}", f"ctx.turn.run_enqueue_{tag}"
    js = nats_broker.connection.jetstream()
    await js.add_stream(StreamConfig(name=name, subjects=[subject], retention=RetentionPolicy.WORK_QUEUE,
                                     storage=StorageType.MEMORY, duplicate_window=600))
    await js.add_consumer(name, ConsumerConfig(durable_name="runner", ack_policy=AckPolicy.EXPLICIT))
    sub = await js.pull_subscribe(subject, durable="runner", stream=name)
    try:
        yield js, name, subject, sub
    finally:
        await sub.unsubscribe()
        await js.delete_stream(name)


def batch(stream: str, events: list[dict], expected: int | None, enqueue: dict | None) -> dict:
    req: dict = {"appends": [{"streamId": stream, "expectedVersion": expected, "events": events}]}
    if enqueue is not None:
        req["enqueue"] = enqueue
    return req


async def stored(js, name: str) -> int:
    return (await js.stream_info(name)).state.messages


async def test_the_message_goes_out_after_the_commit_and_once(persistence, rpc, work_queue):
    js, name, subject, sub = work_queue
    stream, turn_id = f"turn:{new_id()}", f"turn_{uuid.uuid4().hex}"
    body = {"turnId": turn_id, "conversationId": "conv_x", "z": "é ☃", "a": [1, {"b": None}]}
    req = batch(stream, [event("ThingHappened", {"k": 1})], 0, {"subject": subject, "msgId": turn_id, "body": body})
    reply = await rpc.call("ctx.persist.append_batch", req)
    assert reply["enqueued"] is True
    assert reply["results"][0]["toVersion"] == 1

    msgs = await sub.fetch(1, timeout=30)
    assert len(msgs) == 1
    msg = msgs[0]
    # the consumer finds the events it was sent for
    page = await rpc.call("ctx.persist.read_stream", {"streamId": stream})
    assert [e["data"] for e in page["events"]] == [{"k": 1}]
    assert msg.headers["Nats-Msg-Id"] == turn_id
    assert list(json.loads(msg.data).items()) == list(body.items())  # as sent, key order included

    # a retried batch (stored already): published again, dropped by JetStream as a duplicate
    again = await rpc.call("ctx.persist.append_batch", req)
    assert again["enqueued"] is True and again["results"][0]["duplicates"] == 1
    assert await stored(js, name) == 1  # the first one, not yet acknowledged: nothing more
    await msg.ack_sync()


async def test_a_refused_commit_enqueues_nothing(persistence, rpc, work_queue):
    js, name, subject, _ = work_queue
    stream = f"turn:{new_id()}"
    await append(rpc, stream, [event("ThingHappened", {})], expected=0)
    req = batch(stream, [event("ThingHappened", {"k": 2})], 0,
                {"subject": subject, "msgId": new_id(), "body": {"turnId": "t"}})
    with pytest.raises(RemoteError) as err:
        await rpc.call("ctx.persist.append_batch", req)
    assert err.value.code == "version-conflict"
    assert await stored(js, name) == 0
    # a batch that passes next is published: the stream was listening all along
    ok = batch(stream, [event("ThingHappened", {"k": 3})], 1,
               {"subject": subject, "msgId": new_id(), "body": {"turnId": "t"}})
    assert (await rpc.call("ctx.persist.append_batch", ok))["enqueued"] is True
    assert await stored(js, name) == 1


@pytest.mark.parametrize("subject", ["ctx.evt.TurnQueued", "ctx.turn.abort", "ctx.turn.run.*", "ctx.turn.run.>"])
async def test_a_subject_outside_the_prefix_is_refused_and_nothing_stored(persistence, rpc, subject):
    stream = f"turn:{new_id()}"
    req = batch(stream, [event("ThingHappened", {})], 0, {"subject": subject, "msgId": new_id(), "body": {}})
    with pytest.raises(RemoteError) as err:
        await rpc.call("ctx.persist.append_batch", req)
    assert err.value.code == "invalid-payload"
    page = await rpc.call("ctx.persist.read_stream", {"streamId": stream, "last": True})
    assert page["lastVersion"] == 0


async def test_no_stream_for_the_subject_is_not_enqueued_and_the_commit_stands(persistence, rpc):
    stream = f"turn:{new_id()}"
    req = batch(stream, [event("ThingHappened", {})], 0,
                {"subject": f"ctx.turn.run_nostream_{uuid.uuid4().hex[:10]}", "msgId": new_id(), "body": {}})
    reply = await rpc.call("ctx.persist.append_batch", req)
    assert reply["enqueued"] is False
    page = await rpc.call("ctx.persist.read_stream", {"streamId": stream, "last": True})
    assert page["lastVersion"] == 1


async def test_the_edge_hands_its_turn_message_with_the_commit(persistence, rpc, nats_broker):
    """Orchestration's side: the message TurnQueue builds goes with Backends.append_streams, persistence publishes
    it, and the runner's consumer takes it as a valid turn command carrying the recorded TurnQueued data."""
    tag = uuid.uuid4().hex[:10]
    queue = TurnQueue(lambda: nats_broker.connection, QueueConfig(
        stream=f"CTX_TURNS_ENQ_EDGE_{tag}", subject=f"ctx.turn.run_enqueue_edge_{tag}", durable="runner"))
    await queue.ensure()
    try:
        turn_id, conversation_id = f"turn_{tag}", f"conv_{tag}"
        cmd = new_event("TurnQueued", {"turnId": turn_id, "conversationId": conversation_id, "userMessageId": "m1",
                                       "provider": {"kind": "openai", "model": "m"}, "settings": {}})
        message = queue.message(turn_id, conversation_id, cmd["data"])
        await Backends(rpc).append_streams([(f"turn:{turn_id}", [cmd], 0)], enqueue=message)
        assert message.enqueued

        stopping, got = asyncio.Event(), []

        async def handle(delivery) -> None:
            got.append((delivery.turn_id, delivery.queued))
            await delivery.msg.ack()
            stopping.set()

        await asyncio.wait_for(queue.consume(handle, 1, stopping), timeout=30)
        assert got == [(turn_id, cmd["data"])]
    finally:
        await nats_broker.connection.jetstream().delete_stream(queue.config.stream)
