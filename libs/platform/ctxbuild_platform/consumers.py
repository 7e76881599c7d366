"""Consumer loops that never die silently, and whose state readiness can see (SPEC §15.4).

:func:`supervise` runs a consumer loop and restarts it (with backoff) when it ends with an exception — every
exception, ``RecursionError`` and the like included; only cancellation stops it. :class:`ConsumerHealth` is what
``/readyz`` reads: a consumer is *consuming* while its loop runs and its last fetch did not fail; it is not when
the loop crashed (until it is back), keeps failing to fetch, or was never started.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog

log = structlog.get_logger("consumers")


class ConsumerHealth:
    """The state of one consumer loop: ``starting`` → ``consuming`` ↔ ``failing`` (fetch errors, a crash being
    restarted), ``stopped``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.state = "starting"
        self.since = time.monotonic()
        self.error: str | None = None
        self.restarts = 0
        self.task: asyncio.Task | None = None

    def _set(self, state: str, error: str | None = None) -> None:
        if state != self.state:
            self.since = time.monotonic()
        self.state, self.error = state, error

    def consuming(self) -> None:
        self._set("consuming")

    def failing(self, error: str) -> None:
        self._set("failing", error[:300])

    def stopped(self) -> None:
        self._set("stopped")

    @property
    def ok(self) -> bool:
        alive = self.task is not None and not self.task.done()
        return alive and self.state == "consuming"

    def report(self) -> dict:
        return {"name": self.name, "state": self.state, "ok": self.ok, "error": self.error,
                "restarts": self.restarts, "forS": round(time.monotonic() - self.since, 1)}


async def supervise(name: str, loop: Callable[[], Awaitable[None]], health: ConsumerHealth,
                    stopping: asyncio.Event, *, max_backoff_s: float = 10.0) -> None:
    """Run ``loop`` until ``stopping``; an exception is logged, shown in ``health`` and the loop restarted."""
    backoff = 0.5
    while not stopping.is_set():
        try:
            await loop()
            if stopping.is_set():
                break
            health.failing("the consumer loop returned")
            log.error("consumer-loop-ended", consumer=name)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            health.failing(f"{type(exc).__name__}: {exc}")
            log.exception("consumer-loop-crashed", consumer=name, retry_in_s=backoff)
        health.restarts += 1
        try:
            await asyncio.wait_for(stopping.wait(), timeout=backoff)
        except TimeoutError:
            pass
        backoff = min(backoff * 2, max_backoff_s)
    health.stopped()
