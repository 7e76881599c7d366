"""A background loop that an append can wake early, started after start-up and stopped before the pool closes."""

from __future__ import annotations

import asyncio

import structlog

log = structlog.get_logger("worker")


class WakeableWorker:
    """Subclasses implement `_run`, looping until `_stopping` and waiting on `_wake` between rounds."""

    task_name = "worker"
    stop_timeout_s = 10.0

    def __init__(self) -> None:
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

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
        task, self._task = self._task, None
        if task is None:
            return
        try:
            await asyncio.wait_for(task, timeout=self.stop_timeout_s)
        except (TimeoutError, asyncio.CancelledError):
            pass  # wait_for cancelled it; each subclass's unit of work is transactional (see its _run)

    def wake(self) -> None:
        """Work arrived (an append committed): run now instead of at the next poll."""
        self._wake.set()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()
