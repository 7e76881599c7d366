"""Watching one turn live (core NATS, never stored): its text deltas (``ctx.turn.delta.<turnId>``) and the notice
that its terminal event is stored (``ctx.turn.ended.<turnId>``), on one subscription ``ctx.turn.*.<turnId>`` — so
a waiter subscribed before the turn is queued misses neither. Both are wake-ups: the turn's events are the record."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import structlog
from ctxbuild_codec.contract_models import dump
from ctxbuild_codec.models.subjects.ctx_turn_ended_request import TurnEndedNotice
from ctxbuild_platform import contracts
from ctxbuild_platform.errors import InvalidPayload

from .deltas import DELTA_SUBJECT, TurnNotices, publish_notice, text_delta

log = structlog.get_logger("turn_watch")
ENDED_SUBJECT = "ctx.turn.ended"
ENDED_SCHEMA = "subjects/ctx.turn.ended.request.json"


def ended_notice(turn_id: str, type_: str, result: dict[str, Any] | None = None) -> dict[str, Any]:
    """The body of ``ctx.turn.ended.<turnId>`` (InvalidPayload/ValueError when ``result`` does not fit it)."""
    notice = {"turnId": turn_id, "type": type_, **({"result": result} if result is not None else {})}
    return dump(TurnEndedNotice.model_validate(notice))


async def publish_ended(broker: Any, turn_id: str, type_: str, result: dict[str, Any] | None = None) -> None:
    """Fire and forget: a lost notice costs a waiter its backstop read, never the turn. ``result``: a completed
    gateway turn's response summary (the waiter then needs no read)."""
    try:
        await publish_notice(broker, f"{ENDED_SUBJECT}.{turn_id}", ended_notice(turn_id, type_, result))
    except Exception as exc:  # noqa: BLE001 - the terminal event is stored; the notice is a courtesy
        log.debug("ended-not-sent", turn_id=turn_id, error=str(exc)[:200])


class TurnWatch(TurnNotices):
    """A turn's live deltas (``{"step", "seq", "text"}``) and its end, in arrival order on one queue: items are
    ``("delta", dict)`` or ``("ended", type)``. Malformed messages are dropped. Without ``deltas`` (a waiter for
    one whole answer) only the end notice is subscribed to: the turn's other notices are not delivered at all."""

    def __init__(self, maxsize: int = 10_000, deltas: bool = True) -> None:
        self.items: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(maxsize=maxsize)
        if not deltas:
            self.kinds = "ended"

    async def on_message(self, msg: Any) -> None:
        try:
            if msg.subject.startswith(DELTA_SUBJECT + "."):
                d = text_delta(msg.data)
                self.items.put_nowait(("delta", {"step": d.step, "seq": d.seq, "text": d.text}))
            elif msg.subject.startswith(ENDED_SUBJECT + "."):
                body = json.loads(msg.data)
                contracts.validate(ENDED_SCHEMA, body)
                self.items.put_nowait(("ended", body))
        except (ValueError, InvalidPayload, asyncio.QueueFull):
            pass

