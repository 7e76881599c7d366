"""Subjects of the MCP catalog. Request/reply subjects use queue group ``mcp_catalog`` (replicas share the load);
``ctx.mcp.cancel`` and ``ctx.mcp.tools_changed`` are broadcast notifications every replica receives. Thin:
contracts are checked by ``rpc`` (and here for the notifications), the work is the catalog's."""

from __future__ import annotations

import json
from typing import Any

import structlog
from ctxbuild_platform import claims, contracts
from ctxbuild_platform.errors import InvalidPayload, ServiceError
from ctxbuild_platform.rpc import rpc
from faststream.nats import NatsBroker
from faststream.nats.annotations import NatsMessage
from pydantic import ValidationError

from .catalog import Catalog
from .settings import McpServerConfig

QUEUE = "mcp_catalog"
TOOLS_CHANGED = "ctx.mcp.tools_changed"
CANCEL = "ctx.mcp.cancel"
log = structlog.get_logger("mcp_handlers")


async def _notification(broker: NatsBroker, subject: str, message: NatsMessage) -> dict[str, Any] | None:
    """A notification's payload (resolved from the platform's claim check when it came as one), or None."""
    try:
        payload = json.loads(await claims.message_body(broker, message))
        contracts.validate(contracts.subject_contract(subject, "request"), payload)
        return payload
    except (ValueError, ServiceError) as exc:  # not JSON, off contract, or a claim that is gone
        log.warning("notification-rejected", subject=subject, error=str(exc)[:300])
        return None


def make_publisher(broker: NatsBroker) -> Any:
    publisher = broker.publisher(TOOLS_CHANGED, title=TOOLS_CHANGED,
                                 description="A server's tool list really changed (published once per change).")

    async def publish(payload: dict[str, Any]) -> None:
        contracts.validate(contracts.subject_contract(TOOLS_CHANGED, "request"), payload)
        await publisher.publish(json.dumps(payload, separators=(",", ":")).encode(),
                                headers={"content-type": "application/json"})

    return publish


def register(broker: NatsBroker, catalog: Catalog, *, max_workers: int = 16) -> None:
    @rpc(broker, "ctx.mcp.resolve", queue=QUEUE, max_workers=max_workers)
    async def resolve(payload: dict[str, Any]) -> dict[str, Any]:
        """Tools for a turn: the selected servers' tools, a cold server's warm-up awaited (bounded); with a
        dialect, wire-safe schemas and the deferral decision."""
        return await catalog.resolve(payload)

    @rpc(broker, "ctx.mcp.invoke", queue=QUEUE, max_workers=max_workers)
    async def invoke(payload: dict[str, Any]) -> dict[str, Any]:
        """Run one MCP tool; the tool's own failure is an `error-text` output, an unknown id is `not-found`. With
        `turnId` + `callId` a call runs at most once: asked again (a resumed turn), the recorded output answers."""
        return await catalog.invoke(payload["toolId"], payload.get("arguments", {}), payload.get("callId"),
                                    payload.get("timeoutS"), payload.get("turnId"))

    @rpc(broker, "ctx.mcp.meta", queue=QUEUE, max_workers=max_workers)
    async def meta(payload: dict[str, Any]) -> dict[str, Any]:
        """Run a meta-tool (tool_search / tool_inspect / tool_invoke) for a turn whose tools were deferred."""
        return await catalog.meta(payload)

    @rpc(broker, "ctx.mcp.servers.upsert", queue=QUEUE, max_workers=max_workers)
    async def upsert(payload: dict[str, Any]) -> dict[str, Any]:
        """Create or replace one server in the registry (Postgres)."""
        try:
            cfg = McpServerConfig.model_validate(payload["server"])
        except ValidationError as exc:
            raise InvalidPayload(f"invalid server config: {exc.errors()[0]['msg']}") from exc
        return await catalog.upsert_server(cfg)

    @rpc(broker, "ctx.mcp.servers.list", queue=QUEUE, max_workers=max_workers)
    async def list_servers(payload: dict[str, Any]) -> dict[str, Any]:
        """The registered servers with their status (ready / warming / error / disabled / cold)."""
        return await catalog.list_servers(payload.get("ids"))

    @rpc(broker, "ctx.mcp.servers.remove", queue=QUEUE, max_workers=max_workers)
    async def remove(payload: dict[str, Any]) -> dict[str, Any]:
        """Remove one server from the registry (its cache entry and sessions go too)."""
        return await catalog.remove_server(payload["id"])

    @broker.subscriber(CANCEL, title=CANCEL,
                       description="Cancel an in-flight call by callId (and its inner <callId>::… calls); "
                                   "every replica receives it, no reply.")
    async def cancel(message: NatsMessage) -> None:
        payload = await _notification(broker, CANCEL, message)
        if payload is not None:
            n = catalog.cancel(payload["callId"])
            log.info("cancel", call_id=payload["callId"], cancelled=n)

    @broker.subscriber(TOOLS_CHANGED, title="ctx.mcp.tools_changed.sessions",
                       description="Every replica closes its session to a removed server.")
    async def on_tools_changed(message: NatsMessage) -> None:
        payload = await _notification(broker, TOOLS_CHANGED, message)
        if payload is not None and payload.get("reason") == "removed":
            await catalog.drop_connection(payload["serverId"])
