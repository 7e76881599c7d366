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
from ctxbuild_platform.telemetry import publish_span

DELTA_SUBJECT = "ctx.turn.delta"
DELTA_SCHEMA = "subjects/ctx.turn.delta.request.json"


def text_delta(raw: bytes) -> TurnTextDelta:
    """A delta as its contract has it (ValueError / InvalidPayload when it is not one)."""
    body = json.loads(raw)
    contracts.validate(DELTA_SCHEMA, body)
    return parse(TurnTextDelta, body)


async def publish_notice(broker: Any, subject: str, body: dict[str, Any]) -> None:
    """A small live notice (core NATS, no reply) on the broker's nats-py connection, in a PRODUCER span: FastStream's
    publish pipeline cost more than the message, and a turn sends one per streamed text chunk."""
    headers = {"content-type": "application/json"}
    with publish_span(subject, headers):
        await broker.connection.publish(subject, json.dumps(body, ensure_ascii=False).encode(), headers=headers)


async def publish_delta(broker: Any, delta: TurnTextDelta) -> None:
    """Fire and forget (core NATS): a lost delta costs nothing, the step's assistant message is the record."""
    await publish_notice(broker, f"{DELTA_SUBJECT}.{delta.turnId}", dump(delta))


class TurnNotices:
    """One subscription to a turn's live notices, ``ctx.turn.<kinds>.<turnId>`` (every kind: deltas, appended,
    ended; or one): subclasses say what a message means (:meth:`on_message`)."""

    _sub: Any = None
    kinds = "*"  # which notices: every kind, or one (``ended``)

    async def on_message(self, msg: Any) -> None:
        raise NotImplementedError

    async def subscribe(self, connection: Any, turn_id: str) -> None:
        self._sub = await connection.subscribe(f"ctx.turn.{self.kinds}.{turn_id}", cb=self.on_message)

    async def close(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001 - a closed connection has dropped it already
                pass
            self._sub = None


class TurnFeed(TurnNotices):
    """What an SSE stream of one turn listens to, on one subscription ``ctx.turn.*.<turnId>``: the live text deltas
    (kept as they arrived, when ``deltas``: the stream passes the bytes on as they are) and the wake-ups —
    ``ctx.turn.appended.<turnId>`` (an event was stored) and ``ctx.turn.ended.<turnId>`` — that tell it to read the
    turn's events now rather than on its backstop timer. A malformed or surplus delta is dropped: the turn's events
    carry the text anyway."""

    def __init__(self, deltas: bool = True, maxsize: int = 10_000) -> None:
        self.deltas = deltas
        self.live: asyncio.Queue[bytes] = asyncio.Queue(maxsize=maxsize)
        self.stored = asyncio.Event()  # something was appended since the reader last cleared it

    async def on_message(self, msg: Any) -> None:
        if not msg.subject.startswith(DELTA_SUBJECT + "."):
            self.stored.set()
            return
        if not self.deltas:
            return
        try:
            text_delta(msg.data)
            self.live.put_nowait(msg.data)
        except (ValueError, InvalidPayload, asyncio.QueueFull):
            pass

    async def next_delta(self, timeout: float) -> bytes | None:
        """The next live delta, or None once ``timeout`` passed or an append was announced (read the events)."""
        if self.stored.is_set():
            return None
        get = asyncio.ensure_future(self.live.get())
        stored = asyncio.ensure_future(self.stored.wait())
        try:
            await asyncio.wait({get, stored}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stored.cancel()
            if not get.done():
                get.cancel()
        # a delta that arrived while the wait returned is kept, not dropped with its task
        if get.done() and not get.cancelled():
            return get.result()
        return None
