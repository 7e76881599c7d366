"""Durable turns: a JetStream work-queue stream of turn commands, pulled by the runner replicas.

- A turn's command ``{turnId, conversationId}`` goes on ``ctx.turn.run`` with ``Nats-Msg-Id = turnId`` (a retried
  publish is dropped as a duplicate). What to run is in the turn's events (TurnQueued); the message may carry
  that event's data as ``command`` (up to ``COMMAND_MAX_BYTES``) so a first attempt starts without reading the
  stream — the runner's expected-version append of TurnStarted checks that nothing else was written since.
  The edge hands the message to persistence with the commit that records the command (``ctx.persist.append_batch``
  ``enqueue``), which publishes it right after that commit; the edge publishes it itself only when the reply says
  it was not (an older persistence, a failed publish) and when it resubmits a stranded turn.
- A runner fetches only as many commands as it has free slots. While a turn runs, the runner sends
  ``in_progress`` every ``ack_wait/3``; a replica that dies stops the heartbeats, the command is redelivered
  after ``ack_wait`` to another replica, and that one resumes from the events.
- On drain the runner NAKs the turns it is still running (after the drain window) so another replica takes them
  over at once instead of after ``ack_wait``.
- A command that cannot be decoded or validated, or was delivered more than ``max_deliveries`` times, is parked
  on the dead-letter stream (``ctxbuild_platform.deadletter``) and terminated; the pull loop is supervised
  (restarted on any exception) and its state is part of ``/readyz``.
- The command is acknowledged only once the turn has its terminal event (or had one already); a turn whose end
  could not be stored is handed back (``nak`` with a growing delay) and resumed or ended on redelivery.
- ``ctx.turn.abort`` (core NATS, every replica) wakes the replica that runs a turn; the durable part of an abort
  is the TurnAbortRequested event, read at pick-up and by the runner's next write (a version conflict).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Self

import structlog
from ctxbuild_codec.contract_models import dump, parse
from ctxbuild_codec.models.subjects.ctx_turn_run_request import TurnRunCommand
from ctxbuild_platform import contracts
from ctxbuild_platform.consumers import ConsumerHealth, supervise
from ctxbuild_platform.deadletter import DeadLetters
from ctxbuild_platform.errors import InvalidPayload
from ctxbuild_platform.rpc import unprocessable
from ctxbuild_platform.streams import ensure_stream
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

log = structlog.get_logger("work-queue")

RUN_SUBJECT = "ctx.turn.run"
FETCH_FAILURES_BEFORE_RESUBSCRIBE = 3
COMMAND_MAX_BYTES = 64 * 1024  # a larger command stays out of the message: the runner reads it from the stream


@dataclass(frozen=True)
class QueueConfig:
    stream: str = "CTX_TURNS"
    subject: str = RUN_SUBJECT
    durable: str = "turn-runner"
    ack_wait_s: float = 30.0
    duplicate_window_s: float = 600.0
    max_ack_pending: int = 1000
    max_deliveries: int = 10  # a command delivered more often than this is parked (dead letter), not run again
    replicas: int = 1  # stream replicas when this service creates it (3 on a three-node JetStream cluster)


RUN_SCHEMA = "subjects/ctx.turn.run.request.json"


@dataclass
class TurnMessage:
    """A turn's work-queue message, built once: published by the edge, or handed with the command's commit to
    persistence, which publishes it right after that commit (``ctx.persist.append_batch`` ``enqueue``)."""

    subject: str
    turn_id: str  # its Nats-Msg-Id
    body: dict
    payload: bytes  # the body as published (encoded once, when its size was checked)
    enqueued: bool = False  # persistence's reply said JetStream has it: not published again

    def handoff(self) -> dict:
        """The ``enqueue`` of an append_batch request."""
        return {"subject": self.subject, "msgId": self.turn_id, "body": self.body}


def turn_command(raw: bytes) -> TurnRunCommand:
    """A command as its contract has it: decoded, refused when no handler could process it (too deep, a lone
    surrogate), validated against the contract, parsed into the generated model."""
    body = json.loads(raw)
    if (why := unprocessable(body)) is not None:
        raise InvalidPayload(why)
    contracts.validate(RUN_SCHEMA, body)
    return parse(TurnRunCommand, body)


@dataclass
class Delivery:
    """One delivery of a turn command to this replica."""

    command: TurnRunCommand
    attempt: int  # JetStream's delivery count (1 = first)
    msg: Msg

    @property
    def turn_id(self) -> str:
        return self.command.turnId

    @property
    def conversation_id(self) -> str:
        return self.command.conversationId

    @property
    def queued(self) -> dict | None:
        """The TurnQueued data the message carries (version 1 of the turn), if any."""
        return dump(self.command.command) if self.command.command is not None else None

    @property
    def window(self) -> list[dict] | None:
        """The messages of a conversation the command's commit created, if the message carries them."""
        if self.command.command is None or self.command.window is None:
            return None
        return dump(self.command.window)["messages"]


class TurnQueue:
    def __init__(self, connection: Callable[[], NatsClient], config: QueueConfig | None = None,
                 dead_letters: DeadLetters | None = None) -> None:
        self._connection = connection
        self.config = config or QueueConfig()
        self.dead_letters = dead_letters or DeadLetters(connection, "orchestration")
        self.health = ConsumerHealth(self.config.durable)
        self._tasks: set[asyncio.Task] = set()

    def _js(self):
        return self._connection().jetstream(timeout=10)

    async def ensure(self) -> None:
        """Create the stream and the durable pull consumer if they are missing (idempotent, replica-safe)."""
        js, c = self._js(), self.config
        await ensure_stream(js, StreamConfig(name=c.stream, subjects=[c.subject], retention=RetentionPolicy.WORK_QUEUE,
                                             storage=StorageType.FILE, duplicate_window=c.duplicate_window_s,
                                             num_replicas=c.replicas))
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
        await self.dead_letters.ensure()

    def message(self, turn_id: str, conversation_id: str, command: dict | None = None,
                window: list[dict] | None = None) -> TurnMessage:
        """The turn's work-queue message. ``command``: the TurnQueued data just recorded as version 1 of the turn
        (rides along when small); ``window``: the messages of the conversation that same commit created (ride along
        with the command when both fit)."""
        body = dump(TurnRunCommand(turnId=turn_id, conversationId=conversation_id))
        if command is not None:
            tries = ([{**body, "command": command, "window": {"messages": window}}] if window else []) + [
                {**body, "command": command}]
            for full in tries:
                payload = json.dumps(full, ensure_ascii=False).encode()
                if len(payload) <= COMMAND_MAX_BYTES:
                    return TurnMessage(self.config.subject, turn_id, full, payload)
        return TurnMessage(self.config.subject, turn_id, body, json.dumps(body).encode())

    async def publish(self, message: TurnMessage) -> None:
        await self._js().publish(message.subject, message.payload, headers={"Nats-Msg-Id": message.turn_id})

    async def submit(self, turn_id: str, conversation_id: str, command: dict | None = None,
                     window: list[dict] | None = None) -> None:
        """:meth:`message`, published."""
        await self.publish(self.message(turn_id, conversation_id, command, window))

    async def pending(self) -> dict[str, int]:
        info = await self._js().consumer_info(self.config.stream, self.config.durable)
        return {"pending": info.num_pending or 0, "ackPending": info.num_ack_pending or 0,
                "redelivered": info.num_redelivered or 0}

    async def consume(self, handle: Callable[[Delivery], Awaitable[None]], slots: int,
                      stopping: asyncio.Event) -> None:
        """Pull commands while there are free slots, until ``stopping`` is set. ``handle`` owns the delivery
        (ack/nak/heartbeat through :class:`Heartbeat`); at most ``slots`` run at once. The pull loop is
        supervised: whatever it raises is logged, shown in :attr:`health` (``/readyz``) and the loop restarted."""
        free = asyncio.Semaphore(slots)
        await supervise(self.config.durable, lambda: self._consume(handle, free, stopping), self.health, stopping)

    async def _consume(self, handle: Callable[[Delivery], Awaitable[None]], free: asyncio.Semaphore,
                       stopping: asyncio.Event) -> None:
        await self.ensure()  # a deleted consumer is recreated with our config (not the client's defaults)
        sub = await self._js().pull_subscribe(self.config.subject, durable=self.config.durable,
                                              stream=self.config.stream)
        self.health.consuming()
        failures = 0
        try:
            while not stopping.is_set():
                await free.acquire()
                taken = False
                try:
                    if stopping.is_set():
                        break
                    try:
                        msgs = await sub.fetch(1, timeout=1.0)
                    except (TimeoutError, NatsTimeoutError):
                        failures = 0
                        self.health.consuming()
                        continue
                    except Exception as exc:  # connection trouble: back off, the client reconnects
                        if self._connection().is_closed:
                            log.warning("work-queue-connection-closed")
                            self.health.failing("connection closed")
                            break
                        self.health.failing(f"fetch: {type(exc).__name__}: {exc}")
                        log.warning("fetch-failed", error=f"{type(exc).__name__}: {exc}")
                        failures += 1
                        if failures >= FETCH_FAILURES_BEFORE_RESUBSCRIBE:  # e.g. the consumer was deleted
                            raise RuntimeError(f"{failures} fetches failed in a row: resubscribing") from exc
                        await asyncio.sleep(1.0)
                        continue
                    failures = 0
                    self.health.consuming()
                    for msg in msgs:
                        delivery = await self._accept(msg)
                        if delivery is not None:
                            taken = True
                            self._spawn(handle, delivery, free)
                finally:
                    if not taken:
                        free.release()
        finally:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # noqa: BLE001 - already closed on shutdown
                log.debug("unsubscribe-failed", error=str(exc)[:200])

    async def _accept(self, msg: Msg) -> Delivery | None:
        """The delivery a message carries, or None once it is parked: undecodable or invalid at once (garbage
        never gets better), a valid one delivered more than ``max_deliveries`` times (every replica that took it
        died or could not end it)."""
        try:
            deliveries = msg.metadata.num_delivered or 1
            delivery = Delivery(turn_command(msg.data), deliveries, msg)
        except Exception as exc:  # noqa: BLE001 - RecursionError (deep nesting), UnicodeError, invalid: park
            error = exc.message if isinstance(exc, InvalidPayload) else f"{type(exc).__name__}: {exc}"
            log.error("bad-turn-command", size=len(msg.data or b""), error=error[:300])
            await self.dead_letters.park(msg, f"invalid-payload: {error}", consumer=self.config.durable)
            return None
        if deliveries > self.config.max_deliveries:
            await self.dead_letters.park(
                msg, f"max-deliveries: delivered {deliveries} times (bound {self.config.max_deliveries}) without "
                f"an end; turn {delivery.turn_id}", consumer=self.config.durable)
            return None
        return delivery

    def _spawn(self, handle: Callable[[Delivery], Awaitable[None]], delivery: Delivery,
               free: asyncio.Semaphore) -> None:
        async def run() -> None:
            try:
                await handle(delivery)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                log.exception("turn-handler-crashed", turn_id=delivery.turn_id)
                await nak(delivery.msg, delay=retry_delay(delivery.attempt))
            finally:
                free.release()

        task = asyncio.create_task(run(), name=f"turn:{delivery.turn_id}")
        self._tasks.add(task)  # the loop holds a reference: an unreferenced task may be collected mid-run
        task.add_done_callback(self._tasks.discard)


def retry_delay(attempt: int) -> float:
    """How long a handed-back command waits before its next delivery (grows with the deliveries)."""
    return min(2.0 * 2 ** max(0, attempt - 1), 60.0)


async def nak(msg: Msg, delay: float | None = None) -> None:
    try:
        await msg.nak(delay=delay)
    except Exception as exc:  # noqa: BLE001 - connection closing: ack_wait hands it over instead
        log.warning("nak-failed", error=str(exc)[:200])


class Heartbeat:
    """Keeps a delivery alive (``in_progress`` every ack_wait/3) while the turn runs."""

    def __init__(self, msg: Msg, ack_wait_s: float) -> None:
        self.msg = msg
        self.interval = max(0.5, ack_wait_s / 3)
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self._beat())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.msg.in_progress()
            except Exception as exc:  # noqa: BLE001 - a missed beat is retried; ack_wait covers a few of them
                log.warning("heartbeat-failed", error=str(exc))
