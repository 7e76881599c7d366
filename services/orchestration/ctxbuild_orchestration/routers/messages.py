"""/v1/conversations/{id}/messages: the conversation's messages and its tool results read back in full."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.routing import APIRoute

from ..app.edge import Edge
from .common import ID_MAX_CHARS, ID_PATTERN, Caller, ConversationId, MessageId, ToolCallId


def router(edge: Edge, route_class: type[APIRoute]) -> APIRouter:
    api = APIRouter(route_class=route_class)

    @api.get("/conversations/{conversation_id}/messages")
    async def messages(conversation_id: ConversationId, who: Caller, branches: bool = False,
                       anchor: Annotated[str | None, Query(max_length=ID_MAX_CHARS, pattern=ID_PATTERN)] = None
                       ) -> dict[str, Any]:
        """The path from the root to ``anchor`` (default: the latest message); ``branches`` adds, for every path
        message with siblings (regenerated answers), the sibling ids — pass one as ``anchor`` to read that branch."""
        return await edge.messages(who, conversation_id, anchor, branches)

    @api.get("/conversations/{conversation_id}/messages/{message_id}/results/{tool_call_id}")
    async def tool_result(conversation_id: ConversationId, message_id: MessageId,
                          tool_call_id: ToolCallId, who: Caller) -> dict[str, Any]:
        """A tool result read back in full for a UI: persisted envelopes are inflated by the blob store, in-flight
        offloads are read from their blobs; a result that was never trimmed is returned as stored."""
        return await edge.tool_result(who, conversation_id, message_id, tool_call_id)

    return api
