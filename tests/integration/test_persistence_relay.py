"""Outbox relay robustness: the persistence process is SIGKILLed while the relay is mid-stream, then restarted.
A real JetStream durable consumer that records what it applied in Postgres (effect + tracking in one
transaction, dedupe by event id) must end with every event applied exactly once; JetStream itself must hold
each event once (Nats-Msg-Id dedupe of the republished rows). The projection, killed mid-batch as well,
must equal a rebuild.

Runs as its own module because it kills the session's persistence process (the next user restarts it)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid

import asyncpg
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from tests.support.persistence import wait_until

pytestmark = pytest.mark.integration

PER_APPEND = 250  # probe events per append (plus as many UserMessageAdded)
APPENDS = 12


def new_id() -> str:
    return str(uuid.uuid4())


class TrackingConsumer:
    """A JetStream pull consumer with exactly-once *effect*: per message, one Postgres transaction inserts the
    event id (dedupe), applies the effect (adds ``n`` to a running total) and moves the consumer's tracked
    position; the JetStream ack comes after the commit. It also "crashes before the ack" on some first
    deliveries, so JetStream redelivers messages whose effect is already committed."""

    def __init__(self, js, pg: asyncpg.Connection, schema: str, subject: str, durable: str) -> None:
        self.js, self.pg, self.schema, self.subject, self.durable = js, pg, schema, subject, durable
        self.deliveries = 0
        self.redeliveries = 0
        self.skipped_acks = 0
        self.duplicates_ignored = 0
        self._stop = asyncio.Event()

    async def setup(self) -> None:
        s = self.schema
        await self.pg.execute(f"""
            CREATE SCHEMA {s};
            CREATE TABLE {s}.applied (event_id uuid PRIMARY KEY, position bigint NOT NULL, n integer NOT NULL);
            CREATE TABLE {s}.tracking (consumer text PRIMARY KEY, position bigint NOT NULL, total bigint NOT NULL);
            INSERT INTO {s}.tracking VALUES ('{self.durable}', 0, 0);""")
        self.sub = await self.js.pull_subscribe(
            self.subject, durable=self.durable, stream="CTX_EVENTS",
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=1.0, deliver_policy=DeliverPolicy.ALL,
                                  max_ack_pending=20_000))

    async def handle(self, msg) -> None:
        self.deliveries += 1
        if msg.metadata.num_delivered > 1:
            self.redeliveries += 1
        body = json.loads(msg.data)
        s = self.schema
        async with self.pg.transaction():
            inserted = await self.pg.fetchval(
                f"INSERT INTO {s}.applied VALUES ($1, $2, $3) ON CONFLICT (event_id) DO NOTHING RETURNING 1",
                uuid.UUID(body["eventId"]), body["position"], body["data"]["n"])
            if inserted:
                await self.pg.execute(
                    f"UPDATE {s}.tracking SET total = total + $2, position = greatest(position, $3) "
                    "WHERE consumer = $1", self.durable, body["data"]["n"], body["position"])
            else:
                self.duplicates_ignored += 1
        if body["data"]["i"] % 97 == 0 and msg.metadata.num_delivered == 1:
            self.skipped_acks += 1  # "crashed" after the commit, before the ack: JetStream redelivers
            return
        await msg.ack()

    async def run(self) -> None:
        from nats.errors import TimeoutError as NatsTimeout

        while not self._stop.is_set():
            try:
                msgs = await self.sub.fetch(500, timeout=0.5)
            except (NatsTimeout, TimeoutError):
                continue
            for m in msgs:
                await self.handle(m)

    def stop(self) -> None:
        self._stop.set()


async def test_relay_killed_mid_stream_then_restarted_delivers_every_event_once(
        stack, start_service, rpc, nats_broker):
    start_service("persistence")
    url = stack.env["CTX_DATABASE_URL"]
    js = nats_broker._connection.jetstream()
    type_ = f"Probe{uuid.uuid4().hex[:10]}"
    subject = f"ctx.evt.{type_}"
    schema = f"consumer_{uuid.uuid4().hex[:8]}"
    pg = await asyncpg.connect(url)
    consumer_pg = await asyncpg.connect(url)
    # the stream exists once the relay has run (the service creates it); make sure before subscribing
    await rpc.call("ctx.persist.append", {"streamId": f"test:{new_id()}", "expectedVersion": 0, "events": [
        {"eventId": new_id(), "type": "Warmup", "data": {}}]})
    await wait_until(lambda: _stream_exists(js), 15, "CTX_EVENTS created", interval=0.02)
    consumer = TrackingConsumer(js, consumer_pg, schema, subject, durable=f"relaytest-{uuid.uuid4().hex[:8]}")
    await consumer.setup()
    task = asyncio.create_task(consumer.run())
    try:
        conversations = [new_id() for _ in range(APPENDS)]
        expected_total = 0
        first_position = None
        for a, cid in enumerate(conversations):
            events = []
            for i in range(PER_APPEND):
                n = a * PER_APPEND + i
                expected_total += n
                events.append({"eventId": new_id(), "type": type_, "data": {"i": n, "n": n}})
                events.append({"eventId": new_id(), "type": "UserMessageAdded",
                               "data": {"message": {"id": f"m{i}", "role": "user",
                                                    "parts": [{"type": "text", "text": f"message {i}"}]}}})
            res = await rpc.call("ctx.persist.append", {"streamId": f"conversation:{cid}", "expectedVersion": 0,
                                                        "events": events})
            first_position = first_position or res["positions"][0]
        total = APPENDS * PER_APPEND * 2

        async def published() -> int:
            return await pg.fetchval("SELECT count(*) FROM persistence.outbox WHERE position >= $1 "
                                     "AND published_at IS NOT NULL", first_position)

        await wait_until(lambda: _ge(published, total // 4), 30, "relay started", interval=0.02)
        stack.stop("persistence", sig=signal.SIGKILL)  # mid-stream: the open batch's marks are lost
        done_at_kill = await published()
        assert 0 < done_at_kill < total, f"not mid-stream: {done_at_kill}/{total} published at the kill"
        # widen the crash window deterministically: the newest published rows lose their mark as if the kill had
        # landed between JetStream's ack and the UPDATE, so the restarted relay publishes them again
        again = await pg.fetchval(
            "WITH r AS (SELECT position FROM persistence.outbox WHERE position >= $1 AND published_at IS NOT NULL "
            "ORDER BY position DESC LIMIT 200) "
            "UPDATE persistence.outbox o SET published_at = NULL FROM r WHERE o.position = r.position "
            "RETURNING 1", first_position)
        assert again is not None
        projected_at_kill = await pg.fetchval(
            "SELECT position FROM persistence.projection_tracking WHERE name = 'conversation'")

        start_service("persistence")
        await wait_until(lambda: _ge(published, total), 60, "relay finished after the restart", interval=0.02)

        async def consumer_done():
            return await pg.fetchval(f"SELECT count(*) FROM {schema}.applied") >= APPENDS * PER_APPEND

        await wait_until(consumer_done, 30, "consumer applied everything", interval=0.02)
        await asyncio.sleep(1.5)  # past ack_wait: the skipped acks have been redelivered (and ignored)
        consumer.stop()
        await asyncio.wait_for(task, 10)

        applied = await pg.fetchval(f"SELECT count(*) FROM {schema}.applied")
        row = await pg.fetchrow(f"SELECT position, total FROM {schema}.tracking")
        assert applied == APPENDS * PER_APPEND  # every event, once
        assert row["total"] == expected_total  # the effect was applied exactly once per event
        last_probe = await pg.fetchval("SELECT max(position) FROM persistence.events WHERE type = $1", type_)
        assert row["position"] == last_probe
        info = await js.stream_info("CTX_EVENTS", subjects_filter=subject)
        assert info.state.subjects == {subject: APPENDS * PER_APPEND}  # JetStream dropped every republish
        # created by the relay with an age limit (Postgres is the log of record) and the configured replicas
        assert info.config.max_age == 7 * 86_400 and info.config.num_replicas == 1
        assert consumer.redeliveries >= consumer.skipped_acks > 0
        assert consumer.duplicates_ignored >= consumer.skipped_acks
        # the projection was cut mid-way too (or not yet started); after the restart it is complete and equal
        # to a rebuild from the events
        assert projected_at_kill is not None
        for cid in conversations[:3] + conversations[-2:]:
            h = await rpc.call("ctx.persist.history", {"conversationId": cid})
            assert h["source"] == "projection" and len(h["messages"]) == PER_APPEND
        proc = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "ctxbuild_persistence", "rebuild-projections", "--verify"],
            capture_output=True, text=True, env={**os.environ, "CTX_DATABASE_URL": url}, timeout=120, check=False)
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        assert proc.returncode == 0 and report["identical"], report
    finally:
        consumer.stop()
        if not task.done():
            task.cancel()
        try:
            await consumer.sub.unsubscribe()
            await js.delete_consumer("CTX_EVENTS", consumer.durable)
        except Exception as exc:  # noqa: BLE001 - cleanup only
            print(f"consumer cleanup: {exc}")
        await pg.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        await pg.close()
        await consumer_pg.close()
        start_service("persistence")


async def _stream_exists(js) -> bool:
    from nats.js.errors import NotFoundError

    try:
        await js.stream_info("CTX_EVENTS")
        return True
    except NotFoundError:
        return False


async def _ge(fn, n: int) -> bool:
    return await fn() >= n
