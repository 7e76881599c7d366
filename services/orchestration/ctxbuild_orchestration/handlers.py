"""The NATS-side handlers of orchestration, typed by the generated contract models: thin — the adapters decode
and validate, these call the app.

- ``ctx.turn.abort`` (core NATS, every runner replica; ``adapters/aborts.py``): :class:`TurnAbortNotice` → the
  replica running the turn cancels it (the durable record is the TurnAbortRequested event).
- ``ctx.turn.run`` (the JetStream work queue; ``adapters/work_queue.py``): each command is parsed into
  :class:`TurnRunCommand` and its delivery handed to the runner loop (``app/runner_loop.py``).
- ``ctx.turn.delta.<turnId>``: read by the edge's SSE streams (``adapters/deltas.py``, :class:`TurnTextDelta`).

The HTTP side is in ``routers/`` (one router per resource).
"""

from __future__ import annotations

from ctxbuild_codec.models.subjects.ctx_turn_abort_request import TurnAbortNotice
from faststream.nats.fastapi import NatsRouter

from .adapters.aborts import subscribe_aborts
from .app.runner_loop import RunnerLoop


class RunnerHandlers:
    def __init__(self, loop: RunnerLoop) -> None:
        self.loop = loop

    async def on_abort(self, notice: TurnAbortNotice) -> None:
        """Every replica hears it; the one running the turn cancels it."""
        self.loop.abort(notice.turnId, str(notice.reason or "requested"))


def register_runner(router: NatsRouter, handlers: RunnerHandlers) -> None:
    subscribe_aborts(router, handlers.on_abort)
