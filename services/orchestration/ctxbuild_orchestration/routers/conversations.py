"""/v1/conversations: create one, attach files to it."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, File, UploadFile
from fastapi.routing import APIRoute

from ..app.edge import Edge
from .common import Caller, ConversationId
from .models import CreateConversation


def router(edge: Edge, route_class: type[APIRoute]) -> APIRouter:
    api = APIRouter(route_class=route_class)

    @api.post("/conversations", status_code=201)
    async def create_conversation(body: CreateConversation, who: Caller) -> dict[str, Any]:
        return await edge.create_conversation(who, body.title, body.settings.model_dump())

    @api.post("/conversations/{conversation_id}/attachments", status_code=201)
    async def upload_attachment(conversation_id: ConversationId,
                                file: Annotated[UploadFile, File()], who: Caller) -> dict[str, Any]:
        return await edge.attach(who, conversation_id, file.filename or "attachment.txt",
                                 file.content_type or "text/plain", file.read)

    return api
