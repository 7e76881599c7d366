"""The model's text as it streams in (core NATS ``ctx.turn.delta.<turnId>``, no reply, never stored): published by
the runner for the SSE stream of whichever edge replica a client is connected to."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from ctxbuild_codec.contract_models import dump, parse
from ctxbuild_codec.models.subjects.ctx_turn_delta_request import TurnTextDelta
from ctxbuild_platform import contracts
from ctxbuild_platform.errors import InvalidPayload

DELTA_SUBJECT = "ctx.turn.delta"
DELTA_SCHEMA = "subjects/ctx.turn.delta.request.json"


def text_delta(raw: bytes) -> TurnTextDelta:
    """A delta as its contract has it (ValueError / InvalidPayload when it is not one)."""
    body = json.loads(raw)
    contracts.validate(DELTA_SCHEMA, body)
    return parse(TurnTextDelta, body)


async def publish_delta(broker: Any, delta: TurnTextDelta) -> None:
    """Fire and forget (core NATS): a lost delta costs nothing, the step's assistant message is the record."""
    await broker.publish(dump(delta), f"{DELTA_SUBJECT}.{delta.turnId}")


class DeltaFeed:
    """A turn's live deltas, kept as they arrived (the SSE stream passes the bytes on as they are). A malformed or
    surplus delta is dropped: the turn's events carry the text anyway."""

    def __init__(self, maxsize: int = 10_000) -> None:
        self.live: asyncio.Queue[bytes] = asyncio.Queue(maxsize=maxsize)
        self._sub: Any = None

    async def on_message(self, msg: Any) -> None:
        try:
            text_delta(msg.data)
            self.live.put_nowait(msg.data)
        except (ValueError, InvalidPayload, asyncio.QueueFull):
            pass

    async def subscribe(self, connection: Any, turn_id: str) -> None:
        self._sub = await connection.subscribe(f"{DELTA_SUBJECT}.{turn_id}", cb=self.on_message)

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
