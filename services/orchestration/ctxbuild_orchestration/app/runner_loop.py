"""The runner replica's loop: pulls turn commands from the work queue and runs them, heartbeats while a turn runs,
ends the turn an abort names, and on drain hands unfinished turns back."""

from __future__ import annotations

import asyncio

import structlog

from ..adapters.work_queue import Delivery, Heartbeat, TurnQueue, nak, retry_delay
from ..settings import Settings
from .runner import TurnRunner

log = structlog.get_logger("orchestration")


class RunnerLoop:
    """Pulls turn commands and runs them; heartbeats while a turn runs; on drain hands unfinished turns back."""

    def __init__(self, queue: TurnQueue, runner: TurnRunner, settings: Settings) -> None:
        self.queue, self.runner, self.settings = queue, runner, settings
        self.stopping = asyncio.Event()
        self.running: dict[str, asyncio.Task] = {}
        self.aborts: dict[str, str] = {}
        # how this replica's last attempts of turns ended (read by a redelivery that followed one); the newest 4096
        self.outcomes: dict[str, str] = {}
        self._loop_task: asyncio.Task | None = None

    def start(self) -> None:
        self._loop_task = asyncio.create_task(
            self.queue.consume(self.handle, self.settings.max_concurrent_turns, self.stopping), name="turn-pull")
        self.queue.health.task = self._loop_task  # /readyz: a consumer whose loop is gone is not ready

    async def handle(self, d: Delivery) -> None:
        current = self.running.get(d.turn_id)
        if current is not None and not current.done():
            await self._follow(d, current)
            return
        task = asyncio.current_task()
        assert task is not None
        self.running[d.turn_id] = task
        try:
            async with Heartbeat(d.msg, self.settings.turn_ack_wait_s):
                outcome = await self.runner.run(d.turn_id, attempt=d.attempt, queued=d.queued, window=d.window)
            log.info("turn-ended", turn_id=d.turn_id, outcome=outcome, attempt=d.attempt)
            self.outcomes[d.turn_id] = outcome
            while len(self.outcomes) > 4096:
                self.outcomes.pop(next(iter(self.outcomes)))
            await self._settle(d, outcome)
        except asyncio.CancelledError:
            reason = self.aborts.pop(d.turn_id, None)
            if reason is not None:  # an abort: record it, the command is done
                await asyncio.shield(self._abort_recorded(d, reason))
            else:  # drain: hand it back now, another replica resumes from the events
                await asyncio.shield(self._nak(d))
        finally:
            self.running.pop(d.turn_id, None)

    async def _follow(self, d: Delivery, current: asyncio.Task) -> None:
        """A redelivery of a command this replica is still running (its heartbeats were lost for ack_wait, e.g.
        while NATS restarted): no second writer — keep the new delivery alive until the running attempt ends and
        settle it the same way."""
        log.info("turn-redelivered-while-running", turn_id=d.turn_id, attempt=d.attempt)
        async with Heartbeat(d.msg, self.settings.turn_ack_wait_s):
            await asyncio.wait({current})  # not cancelled with this task (a drain cancels the runner's own)
        await self._settle(d, self.outcomes.get(d.turn_id, "unended"))

    async def _settle(self, d: Delivery, outcome: str) -> None:
        if outcome == "unended":  # the terminal event is not stored: never acknowledged before it is
            await nak(d.msg, delay=retry_delay(d.attempt))
        elif outcome == "unknown":  # no TurnQueued: nothing will ever run it — parked, not dropped
            await self.queue.dead_letters.park(d.msg, f"turn-unknown: turn:{d.turn_id} has no TurnQueued",
                                               consumer=self.queue.config.durable)
        elif outcome != "taken-over":
            await d.msg.ack()

    async def _abort_recorded(self, d: Delivery, reason: str) -> None:
        try:
            async with Heartbeat(d.msg, self.settings.turn_ack_wait_s):
                await self.runner.abort_now(d.turn_id, reason)
        except Exception as exc:  # noqa: BLE001 - not recorded: the redelivery reads TurnAbortRequested and ends it
            log.error("abort-not-recorded", turn_id=d.turn_id, error=f"{type(exc).__name__}: {exc}"[:300])
            await nak(d.msg, delay=retry_delay(d.attempt))
            return
        await d.msg.ack()

    async def _nak(self, d: Delivery) -> None:
        await nak(d.msg)

    def abort(self, turn_id: str, reason: str) -> None:
        task = self.running.get(turn_id)
        if task is not None:
            self.aborts[turn_id] = reason
            task.cancel()

    async def drain(self, timeout: float) -> None:
        self.stopping.set()
        if self._loop_task:
            await asyncio.gather(self._loop_task, return_exceptions=True)
        tasks = list(self.running.values())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
