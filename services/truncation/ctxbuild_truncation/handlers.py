"""``ctx.truncate.step``: raw request bytes → raw reply bytes, deciding only where the CPU work runs.

- A request up to ``loop_max_bytes`` with at most ``loop_max_parts`` parts and no claims is answered on the event
  loop by the platform's ``rpc.dispatch`` (contracts, typed handler :meth:`StepHandler.step`, error mapping), as
  every ``@rpc`` subject is: cheaper on the loop than thread hops.
- Anything larger has its decode/validate/plan and apply/validate/encode on the service's CPU threads, so small
  requests keep being answered while a large one is being cut; its reply shape and error mapping are those of
  ``dispatch`` (``{"result": …}`` | ``{"error": {code, message, retryable}}``).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

import structlog
from ctxbuild_codec.contract_models import dump
from ctxbuild_codec.models.subjects.ctx_truncate_step_reply import CtxTruncateStepReply
from ctxbuild_codec.models.subjects.ctx_truncate_step_request import CtxTruncateStepRequest
from ctxbuild_platform.claims import encode_json
from ctxbuild_platform.rpc import dispatch, error_reply

from . import app, wire
from .app import SUBJECT, Limits

log = structlog.get_logger("truncation")
T = TypeVar("T")


class StepHandler:
    """Raw request bytes → raw reply bytes, with the CPU work on ``executor`` unless the request is small."""

    def __init__(self, store: Any, executor: Executor, *, limits: Limits | None = None,
                 loop_max_bytes: int = 256 * 1024, loop_max_parts: int = 64, max_claims: int = 4) -> None:
        self.store = store
        self.executor = executor
        self.limits = limits or Limits()
        self.loop_max_bytes = loop_max_bytes
        self.loop_max_parts = loop_max_parts
        self.claim_slots = asyncio.Semaphore(max_claims)

    async def step(self, req: CtxTruncateStepRequest) -> CtxTruncateStepReply:
        """The step on the event loop (a small request, already checked against the contract)."""
        reply = await app.run_step(dump(req), self.store, limits=self.limits, claim_slots=self.claim_slots)
        return CtxTruncateStepReply.model_validate(reply)

    async def _on_thread(self, fn: Callable[..., T], *args: Any) -> T:
        ctx = contextvars.copy_context()  # the trace context follows the work (log lines keep their trace ids)
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(ctx.run, fn, *args))

    def _on_loop(self, raw: bytes) -> bool:
        """Small enough for the loop: few bytes, few parts (validation cost), no claims — judged on the bytes, so a
        small request is parsed once, by ``dispatch`` (every part carries ``"type":"tool-result"``; a count that
        also matches inside a tool output only sends the request to the threads)."""
        return (len(raw) <= self.loop_max_bytes and b'"claims"' not in raw
                and raw.count(b'"tool-result"') <= self.loop_max_parts)

    async def handle(self, raw: bytes) -> bytes:
        if self._on_loop(raw):
            return encode_json(await dispatch(SUBJECT, raw, self.step, CtxTruncateStepRequest))
        try:
            if len(raw) <= self.loop_max_bytes:  # small but many parts or claims: parsed here, checked on a thread
                payload = await self._on_thread(app.check, wire.parse(raw))
            else:
                payload = await self._on_thread(app.decode, raw)
            return await app.run_step(payload, self.store, offload=self._on_thread, limits=self.limits,
                                      claim_slots=self.claim_slots, encoded=True)
        except Exception as exc:  # noqa: BLE001 — a typed reply, never a bare crash
            return wire.encode(error_reply(SUBJECT, exc))
