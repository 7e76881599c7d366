"""``ctx.mcp.tools_changed``, published on the app's broker (contract-checked before it leaves)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from ctxbuild_platform import contracts
from faststream.nats import NatsBroker

TOOLS_CHANGED = "ctx.mcp.tools_changed"


def make_publisher(broker: NatsBroker) -> Callable[[dict[str, Any]], Awaitable[None]]:
    publisher = broker.publisher(TOOLS_CHANGED, title=TOOLS_CHANGED,
                                 description="A server's tool list really changed (published once per change).")

    async def publish(payload: dict[str, Any]) -> None:
        contracts.validate(contracts.subject_contract(TOOLS_CHANGED, "request"), payload)
        await publisher.publish(json.dumps(payload, separators=(",", ":")).encode(),
                                headers={"content-type": "application/json"})

    return publish
