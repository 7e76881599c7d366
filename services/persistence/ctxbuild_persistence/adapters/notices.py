"""A turn's live notices sent from the commit that ends it (``ctx.persist.complete_turn`` ``endNotice``): core NATS,
no reply, never stored — ``ctx.turn.appended.<turnId>`` then ``ctx.turn.ended.<turnId>``, on the broker's own
connection, so they leave before the reply does and the edge waiting for the turn need not wait for the runner to
relay them. Wake-ups only: the turn's events are the record, a lost notice costs a waiter its backstop read."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import structlog
from ctxbuild_platform.telemetry import publish_span
from nats.aio.client import Client as NatsClient

log = structlog.get_logger("notices")
APPENDED_SUBJECT = "ctx.turn.appended"
ENDED_SUBJECT = "ctx.turn.ended"


class TurnNotices:
    def __init__(self, connection: Callable[[], NatsClient]) -> None:
        self._connection = connection

    async def turn_ended(self, turn_id: str, to_version: int, notice: dict[str, Any]) -> bool:
        """Fire and forget (the subjects from ``turn_id``, the caller's ``notice`` as its body): True once both
        are handed to the connection, False on any failure (the caller then sends them itself)."""
        try:
            nc = self._connection()
            await _publish(nc, f"{APPENDED_SUBJECT}.{turn_id}", {"turnId": turn_id, "toVersion": to_version})
            await _publish(nc, f"{ENDED_SUBJECT}.{turn_id}", notice)
            return True
        except Exception as exc:  # noqa: BLE001 - the commit stands; the notice is a courtesy
            log.warning("end-notice-not-sent", turn_id=turn_id, error=f"{type(exc).__name__}: {exc}"[:300])
            return False


async def _publish(nc: NatsClient, subject: str, body: dict[str, Any]) -> None:
    headers = {"content-type": "application/json"}
    with publish_span(subject, headers):  # a PRODUCER span, as FastStream would make (orchestration's publish_notice)
        await nc.publish(subject, json.dumps(body, ensure_ascii=False).encode(), headers=headers)
