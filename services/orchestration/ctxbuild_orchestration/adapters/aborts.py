"""``ctx.turn.abort`` (core NATS, no reply, every runner replica): the wake-up for the replica that runs a turn. The
durable record of an abort is the TurnAbortRequested event, appended by the edge first."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from ctxbuild_codec.contract_models import dump, parse
from ctxbuild_codec.models.subjects.ctx_turn_abort_request import TurnAbortNotice
from ctxbuild_platform import contracts
from ctxbuild_platform.errors import InvalidPayload
from faststream.nats.fastapi import NatsRouter

log = structlog.get_logger("orchestration")
ABORT_SUBJECT = "ctx.turn.abort"
ABORT_SCHEMA = "subjects/ctx.turn.abort.request.json"


def abort_notice(body: Any) -> TurnAbortNotice:
    """A decoded notice as its contract has it (InvalidPayload when it is not one)."""
    contracts.validate(ABORT_SCHEMA, body)
    return parse(TurnAbortNotice, body)


async def publish_abort(broker: Any, notice: TurnAbortNotice) -> None:
    """The wake-up for whichever replica runs the turn (every replica hears it)."""
    await broker.publish(dump(notice), ABORT_SUBJECT)


def subscribe_aborts(router: NatsRouter, handle: Callable[[TurnAbortNotice], Awaitable[None]]) -> None:
    """Every notice, validated and parsed, to ``handle``; a malformed one is logged and dropped."""
    @router.subscriber(ABORT_SUBJECT)
    async def on_abort(body: dict[str, Any]) -> None:
        try:
            notice = abort_notice(body)
        except InvalidPayload as exc:
            log.warning("bad-abort-notice", error=exc.message)
            return
        await handle(notice)
