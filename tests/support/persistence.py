"""Helpers of the persistence integration tests: ids, request events and ``ctx.persist.append``."""

from __future__ import annotations

import uuid


def new_id() -> str:
    return str(uuid.uuid4())


def event(type_: str, data: dict, **extra) -> dict:
    return {"eventId": new_id(), "type": type_, "data": data, **extra}


async def append(rpc, stream: str, events: list[dict], expected: int | None = None) -> dict:
    return await rpc.call("ctx.persist.append", {"streamId": stream, "expectedVersion": expected, "events": events})
