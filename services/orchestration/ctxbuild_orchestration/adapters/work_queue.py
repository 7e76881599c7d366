"""Durable turns: a JetStream work-queue stream of turn commands, pulled by the runner replicas.

- The edge publishes ``{turnId, conversationId}`` on ``ctx.turn.run`` with ``Nats-Msg-Id = turnId`` (a retried
  publish is dropped as a duplicate). What to run is in the turn's events (TurnQueued), not in the message.
- A runner fetches only as many commands as it has free slots. While a turn runs, the runner sends
  ``in_progress`` every ``ack_wait/3``; a replica that dies stops the heartbeats, the command is redelivered
  after ``ack_wait`` to another replica, and that one resumes from the events.
- On drain the runner NAKs the turns it is still running (after the drain window) so another replica takes them
  over at once instead of after ``ack_wait``.
- ``ctx.turn.abort`` (core NATS, every replica) wakes the replica that runs a turn; the durable part of an abort
  is the TurnAbortRequested event, read at pick-up and by the runner's next write (a version conflict).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog
from ctxbuild_platform import contracts
from ctxbuild_platform.errors import InvalidPayload
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

log = structlog.get_logger("work-queue")

RUN_SUBJECT = "ctx.turn.run"
ABORT_SUBJECT = "ctx.turn.abort"


@dataclass(frozen=True)
class QueueConfig:
    stream: str = "CTX_TURNS"
    subject: str = RUN_SUBJECT
    durable: str = "turn-runner"
    ack_wait_s: float = 30.0
    duplicate_window_s: float = 600.0
    max_ack_pending: int = 1000
    replicas: int = 1  # stream replicas when this service creates it (3 on a three-node JetStream cluster)


@dataclass
class Delivery:
    """One delivery of a turn command to this replica."""

    turn_id: str
    conversation_id: str
    attempt: int  # JetStream's delivery count (1 = first)
    msg: Msg


class TurnQueue:
    def __init__(self, connection: Callable[[], NatsClient], config: QueueConfig | None = None) -> None:
        self._connection = connection
        self.config = config or QueueConfig()

    def _js(self):
        return self._connection().jetstream(timeout=10)

    async def ensure(self) -> None:
        """Create the stream and the durable pull consumer if they are missing (idempotent, replica-safe)."""
        js, c = self._js(), self.config
        try:
            await js.stream_info(c.stream)
        except NotFoundError:
            try:
                await js.add_stream(StreamConfig(name=c.stream, subjects=[c.subject],
                                                 retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE,
                                                 duplicate_window=c.duplicate_window_s, num_replicas=c.replicas))
            except BadRequestError:
                await js.stream_info(c.stream)  # another replica created it
        try:
            await js.consumer_info(c.stream, c.durable)
        except NotFoundError:
            try:
                await js.add_consumer(c.stream, ConsumerConfig(
                    durable_name=c.durable, ack_policy=AckPolicy.EXPLICIT, ack_wait=c.ack_wait_s,
                    deliver_policy=DeliverPolicy.ALL, max_deliver=-1, max_ack_pending=c.max_ack_pending,
                    filter_subject=c.subject))
            except BadRequestError:
                await js.consumer_info(c.stream, c.durable)

    async def submit(self, turn_id: str, conversation_id: str) -> None:
        payload = json.dumps({"turnId": turn_id, "conversationId": conversation_id}).encode()
        await self._js().publish(self.config.subject, payload, headers={"Nats-Msg-Id": turn_id})

    async def pending(self) -> dict[str, int]:
        info = await self._js().consumer_info(self.config.stream, self.config.durable)
        return {"pending": info.num_pending or 0, "ackPending": info.num_ack_pending or 0,
                "redelivered": info.num_redelivered or 0}

    async def consume(self, handle: Callable[[Delivery], Awaitable[None]], slots: int,
                      stopping: asyncio.Event) -> None:
        """Pull commands while there are free slots, until ``stopping`` is set. ``handle`` owns the delivery
        (ack/nak/heartbeat through :class:`Heartbeat`); at most ``slots`` run at once."""
        sub = await self._js().pull_subscribe(self.config.subject, durable=self.config.durable, stream=self.config.stream)
        free = asyncio.Semaphore(slots)
        try:
            while not stopping.is_set():
                await free.acquire()
                if stopping.is_set():
                    free.release()
                    break
                try:
                    msgs = await sub.fetch(1, timeout=1.0)
                except (NatsTimeoutError, asyncio.TimeoutError):
                    free.release()
                    continue
                except Exception as exc:  # connection trouble: back off, the client reconnects
                    free.release()
                    if self._connection().is_closed:
                        log.warning("work-queue-connection-closed")
                        break
                    log.warning("fetch-failed", error=f"{type(exc).__name__}: {exc}")
                    await asyncio.sleep(1.0)
                    continue
                for msg in msgs:
                    try:
                        body = json.loads(msg.data)
                        contracts.validate("subjects/ctx.turn.run.request.json", body)
                        delivery = Delivery(body["turnId"], body["conversationId"],
                                            msg.metadata.num_delivered or 1, msg)
                    except (ValueError, KeyError, TypeError, InvalidPayload):
                        log.error("bad-turn-command", data=msg.data[:200])
                        await msg.term()  # never redeliver garbage
                        free.release()
                        continue

                    async def run(d: Delivery = delivery) -> None:
                        try:
                            await handle(d)
                        finally:
                            free.release()

                    asyncio.create_task(run(), name=f"turn:{delivery.turn_id}")
        finally:
            try:
                await sub.unsubscribe()
            except Exception:  # already closed on shutdown
                pass


class Heartbeat:
    """Keeps a delivery alive (``in_progress`` every ack_wait/3) while the turn runs."""

    def __init__(self, msg: Msg, ack_wait_s: float) -> None:
        self.msg = msg
        self.interval = max(0.5, ack_wait_s / 3)
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> Heartbeat:
        self._task = asyncio.create_task(self._beat())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.msg.in_progress()
            except Exception as exc:
                log.warning("heartbeat-failed", error=str(exc))
