"""A background loop over the database that an append can wake early, started after start-up and stopped before
the pool closes: the outbox relay and the projector."""

from __future__ import annotations

import asyncio
import time

import structlog

from .db import Database

log = structlog.get_logger("worker")


class WakeableWorker:
    """Rounds of work (:meth:`round`, one transaction each) until stopped: another round at once while there is
    more, else a wait for :meth:`wake` or ``poll_interval_s``; a failed round is retried after a backoff that
    doubles up to ``max_backoff_s`` (the loop outlives Postgres and NATS hiccups).

    Wake-ups are coalesced: a round woken less than ``min_interval_s`` after the previous round started waits
    out the rest of that interval, so a burst of appends costs one round (a few statements and a commit) per
    interval instead of one per append, and the appends do not queue behind the rounds' work in this process and in
    Postgres. An append after a quiet spell still starts a round at once. ``wake(urgent=True)`` (someone waits
    for the round, e.g. a read-your-writes history read) cuts the wait short."""

    task_name = "worker"
    stop_timeout_s = 10.0

    def __init__(self, db: Database, *, batch_size: int, poll_interval_s: float, max_backoff_s: float,
                 min_interval_s: float = 0.0) -> None:
        self.db = db
        self.batch_size = batch_size
        self.poll_interval_s = poll_interval_s
        self.max_backoff_s = max_backoff_s
        self.min_interval_s = min_interval_s
        self._wake = asyncio.Event()
        self._urgent = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task | None = None

    async def round(self) -> int | None:  # pragma: no cover - abstract
        """One unit of work; how much it did (None: nothing to report)."""
        raise NotImplementedError

    def more(self, done: int | None) -> bool:
        """Whether more work is waiting after a round that did ``done``."""
        return bool(done)

    def idle_timeout(self, done: int | None) -> float:
        return self.poll_interval_s

    async def failed(self, error: str, retry_in_s: float) -> None:
        """A round raised (logged by the subclass; the loop sleeps ``retry_in_s`` next)."""

    async def _coalesce(self, started: float) -> None:
        """Wait out the rest of ``min_interval_s`` since the last round started (unless urgent or stopping)."""
        rest = started + self.min_interval_s - time.monotonic()
        if rest > 0 and not self._urgent.is_set() and not self._stopping:
            try:
                await asyncio.wait_for(self._urgent.wait(), timeout=rest)
            except TimeoutError:
                pass

    async def _run(self) -> None:
        backoff = 0.0
        while not self._stopping:
            self._wake.clear()  # a wake() from here on triggers another round
            self._urgent.clear()
            started = time.monotonic()
            try:
                done = await self.round()
                backoff = 0.0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the loop must outlive NATS/Postgres hiccups
                backoff = min(max(backoff * 2, 0.1), self.max_backoff_s)
                await self.failed(f"{type(exc).__name__}: {exc}"[:500], backoff)
                await asyncio.sleep(backoff)  # not woken by appends: a failing dependency gets a rest
                continue
            if self.more(done):
                continue
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.idle_timeout(done))
            except TimeoutError:
                continue
            await self._coalesce(started)  # woken: more appends may land in this interval, one round takes them
        log.info("worker-stopped", worker=self.task_name)

    async def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._task = asyncio.create_task(self._run(), name=self.task_name)
            self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        """A loop that ends without being stopped (an exception its own handling let through) is logged and
        restarted a second later — never a silent death; readiness reads :attr:`running` meanwhile."""
        if self._stopping or task.cancelled() or task is not self._task:
            return
        log.error("worker-died", worker=self.task_name, error=repr(task.exception())[:300])
        self._task = None
        asyncio.get_running_loop().call_later(1.0, lambda: None if self._stopping else asyncio.ensure_future(
            self.start()))

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._urgent.set()
        task, self._task = self._task, None
        if task is None:
            return
        try:
            await asyncio.wait_for(task, timeout=self.stop_timeout_s)
        except (TimeoutError, asyncio.CancelledError):
            pass  # wait_for cancelled it; each subclass's unit of work is transactional (see its _run)

    def wake(self, *, urgent: bool = False) -> None:
        """Work arrived (an append committed): run now instead of at the next poll — or, right after a round,
        once ``min_interval_s`` has passed since it started (``urgent``: now)."""
        self._wake.set()
        if urgent:
            self._urgent.set()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()
