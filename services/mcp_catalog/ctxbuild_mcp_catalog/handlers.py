"""Subjects of the MCP catalog (queue group ``mcp_catalog``). Thin: contracts are checked by ``rpc``, the work
is the catalog's."""

from __future__ import annotations

from typing import Any

from ctxbuild_platform.rpc import rpc
from faststream.nats import NatsBroker

from .catalog import Catalog

QUEUE = "mcp_catalog"


def register(broker: NatsBroker, catalog: Catalog, *, max_workers: int = 16) -> None:
    @rpc(broker, "ctx.mcp.resolve", queue=QUEUE, max_workers=max_workers)
    async def resolve(payload: dict[str, Any]) -> dict[str, Any]:
        """Tools for a turn: the selected servers' tools, a cold server's warm-up awaited (bounded)."""
        return await catalog.resolve(payload.get("mode"), payload.get("serverIds"), payload.get("warmTimeoutS"))

    @rpc(broker, "ctx.mcp.invoke", queue=QUEUE, max_workers=max_workers)
    async def invoke(payload: dict[str, Any]) -> dict[str, Any]:
        """Run one MCP tool; the tool's own failure is an `error-text` output, an unknown id is `not-found`."""
        return await catalog.invoke(payload["toolId"], payload.get("arguments", {}), payload.get("callId"))
