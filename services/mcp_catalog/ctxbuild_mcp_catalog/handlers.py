"""Subjects of the MCP catalog. Request/reply subjects use queue group ``mcp_catalog`` (replicas share the load);
``ctx.mcp.cancel`` and ``ctx.mcp.tools_changed`` are broadcast notifications every replica receives. Thin: each
handler takes the subject's generated request model and returns its reply model (contracts are checked by ``rpc``,
and here for the notifications); the work is the app's."""

from __future__ import annotations

import json
from typing import TypeVar

import structlog
from ctxbuild_codec.contract_models import dump
from ctxbuild_codec.models.subjects.ctx_mcp_cancel_request import McpCancel
from ctxbuild_codec.models.subjects.ctx_mcp_invoke_reply import McpInvokeReply
from ctxbuild_codec.models.subjects.ctx_mcp_invoke_request import McpInvokeRequest
from ctxbuild_codec.models.subjects.ctx_mcp_meta_reply import McpMetaReply
from ctxbuild_codec.models.subjects.ctx_mcp_meta_request import McpMetaRequest
from ctxbuild_codec.models.subjects.ctx_mcp_resolve_reply import McpResolveReply
from ctxbuild_codec.models.subjects.ctx_mcp_resolve_request import McpResolveRequest
from ctxbuild_codec.models.subjects.ctx_mcp_servers_list_reply import McpServerListReply
from ctxbuild_codec.models.subjects.ctx_mcp_servers_list_request import McpServerListRequest
from ctxbuild_codec.models.subjects.ctx_mcp_servers_remove_reply import McpServerRemoveReply
from ctxbuild_codec.models.subjects.ctx_mcp_servers_remove_request import McpServerRemoveRequest
from ctxbuild_codec.models.subjects.ctx_mcp_servers_upsert_reply import McpServerUpsertReply
from ctxbuild_codec.models.subjects.ctx_mcp_servers_upsert_request import McpServerUpsertRequest
from ctxbuild_codec.models.subjects.ctx_mcp_tools_changed_request import McpToolsChanged
from ctxbuild_platform import claims, contracts
from ctxbuild_platform.errors import InvalidPayload, ServiceError
from ctxbuild_platform.rpc import rpc
from faststream.nats import NatsBroker
from faststream.nats.annotations import NatsMessage
from pydantic import BaseModel, ValidationError

from .adapters.notifications import TOOLS_CHANGED
from .app import Catalog
from .settings import McpServerConfig

QUEUE = "mcp_catalog"
CANCEL = "ctx.mcp.cancel"
log = structlog.get_logger("mcp_handlers")
M = TypeVar("M", bound=BaseModel)


async def _notification(broker: NatsBroker, subject: str, model: type[M], message: NatsMessage) -> M | None:
    """A notification as its model (resolved from the platform's claim check when it came as one), or None."""
    try:
        payload = json.loads(await claims.message_body(broker, message))
        contracts.validate(contracts.subject_contract(subject, "request"), payload)
        return model.model_validate(payload)
    except (ValueError, ServiceError) as exc:  # not JSON, off contract, or a claim that is gone
        log.warning("notification-rejected", subject=subject, error=str(exc)[:300])
        return None


def register(broker: NatsBroker, catalog: Catalog, *, max_workers: int = 16) -> None:
    @rpc(broker, "ctx.mcp.resolve", queue=QUEUE, max_workers=max_workers)
    async def resolve(req: McpResolveRequest) -> McpResolveReply:
        """Tools for a turn: the selected servers' tools, a cold server's warm-up awaited (bounded); with a
        dialect, wire-safe schemas and the deferral decision."""
        return McpResolveReply.model_validate(await catalog.resolve(dump(req)))

    @rpc(broker, "ctx.mcp.invoke", queue=QUEUE, max_workers=max_workers)
    async def invoke(req: McpInvokeRequest) -> McpInvokeReply:
        """Run one MCP tool; the tool's own failure is an `error-text` output, an unknown id is `not-found`. With
        `turnId` + `callId` a call runs at most once: asked again (a resumed turn), the recorded output answers."""
        return McpInvokeReply.model_validate(
            await catalog.invoke(req.toolId, req.arguments, req.callId, req.timeoutS, req.turnId))

    @rpc(broker, "ctx.mcp.meta", queue=QUEUE, max_workers=max_workers)
    async def meta(req: McpMetaRequest) -> McpMetaReply:
        """Run a meta-tool (tool_search / tool_inspect / tool_invoke) for a turn whose tools were deferred."""
        return McpMetaReply.model_validate(await catalog.meta(dump(req)))

    @rpc(broker, "ctx.mcp.servers.upsert", queue=QUEUE, max_workers=max_workers)
    async def upsert(req: McpServerUpsertRequest) -> McpServerUpsertReply:
        """Create or replace one server in the registry (Postgres)."""
        try:
            cfg = McpServerConfig.model_validate(dump(req.server))
        except ValidationError as exc:
            raise InvalidPayload(f"invalid server config: {exc.errors()[0]['msg']}") from exc
        return McpServerUpsertReply.model_validate(await catalog.upsert_server(cfg))

    @rpc(broker, "ctx.mcp.servers.list", queue=QUEUE, max_workers=max_workers)
    async def list_servers(req: McpServerListRequest) -> McpServerListReply:
        """The registered servers with their status (ready / warming / error / disabled / cold)."""
        ids = None if req.ids is None else [i.root for i in req.ids]
        return McpServerListReply.model_validate(await catalog.list_servers(ids))

    @rpc(broker, "ctx.mcp.servers.remove", queue=QUEUE, max_workers=max_workers)
    async def remove(req: McpServerRemoveRequest) -> McpServerRemoveReply:
        """Remove one server from the registry (its cache entry and sessions go too)."""
        return McpServerRemoveReply.model_validate(await catalog.remove_server(req.id))

    @broker.subscriber(CANCEL, title=CANCEL,
                       description="Cancel an in-flight call by callId (and its inner <callId>::… calls); "
                                   "every replica receives it, no reply.")
    async def cancel(message: NatsMessage) -> None:
        req = await _notification(broker, CANCEL, McpCancel, message)
        if req is not None:
            n = catalog.cancel(req.callId)
            log.info("cancel", call_id=req.callId, cancelled=n)

    @broker.subscriber(TOOLS_CHANGED, title="ctx.mcp.tools_changed.sessions",
                       description="Every replica closes its session to a removed server.")
    async def on_tools_changed(message: NatsMessage) -> None:
        change = await _notification(broker, TOOLS_CHANGED, McpToolsChanged, message)
        if change is not None and change.reason == "removed":
            await catalog.drop_connection(change.serverId)
