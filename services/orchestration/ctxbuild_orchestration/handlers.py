"""HTTP/SSE edge (FastAPI). Thin: validate, hand to the backends or the runner, map typed errors to HTTP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from ctxbuild_platform.errors import RemoteError, ServiceError
from ctxbuild_providers import Provider
from fastapi import APIRouter, FastAPI, File, Header, Request, UploadFile
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sse_starlette import EventSourceResponse

from .adapters.backends import Backends, new_event
from .runner import TurnRunner, new_id

TERMINAL = {"TurnCompleted", "TurnFailed"}
STATUS = {"invalid-payload": 422, "not-found": 404, "version-conflict": 409, "unavailable": 503, "timeout": 504,
          "provider-not-configured": 400, "unsupported-media": 415}


class ConversationSettings(BaseModel):
    contextWindow: int | None = Field(None, gt=0, description="model context window in tokens; null = unknown")
    reservation: int | None = Field(None, ge=0)
    truncateThreshold: int | None = Field(None, ge=2000)
    maxMessages: int | None = Field(None, ge=1)
    compressEnabled: bool = True
    mcpMode: Literal["manual", "auto", "disabled"] = "manual"
    mcpServers: list[str] = Field(default_factory=list)


class CreateConversation(BaseModel):
    title: str | None = None
    settings: ConversationSettings = Field(default_factory=ConversationSettings)


class ReplaySpec(BaseModel):
    """Scripted model decisions (offline runs, demos, tests)."""

    kind: Literal["replay"]
    script: list[dict[str, Any]] = Field(min_length=1)


class OpenAISpec(BaseModel):
    """A real model behind the server's configured OpenAI-compatible endpoint (CTX_OPENAI_BASE_URL/API_KEY)."""

    kind: Literal["openai"]
    model: str = Field(min_length=1)


class AnthropicSpec(BaseModel):
    """A Claude model through the Messages API (CTX_ANTHROPIC_API_KEY, optional CTX_ANTHROPIC_BASE_URL)."""

    kind: Literal["anthropic"]
    model: str = Field(min_length=1)


class CreateTurn(BaseModel):
    text: str = Field(min_length=1)
    provider: Annotated[ReplaySpec | OpenAISpec | AnthropicSpec, Field(discriminator="kind")]


def error_response(exc: ServiceError) -> JSONResponse:
    if isinstance(exc, RemoteError):
        # a backend refusing our own request is our fault (502), not the client's (422)
        status = {"not-found": 404, "version-conflict": 409}.get(exc.code, 503 if exc.retryable else 502)
    else:
        status = STATUS.get(exc.code, 500)
    return JSONResponse(exc.to_payload(), status_code=status)


def build_api(backends: Backends, runner: TurnRunner, sse_poll_s: float,
              provider_for: Callable[[BaseModel], Provider]) -> APIRouter:
    api = APIRouter(prefix="/v1")
    tasks: set[asyncio.Task] = set()

    async def conversation_settings(conversation_id: str) -> dict[str, Any]:
        first = await backends.read_stream(f"conversation:{conversation_id}", 1, limit=1)
        if not first["events"] or first["events"][0]["type"] != "ConversationCreated":
            raise ServiceError(f"conversation {conversation_id} not found", code="not-found")
        return first["events"][0]["data"].get("settings", {})

    @api.post("/conversations", status_code=201)
    async def create_conversation(body: CreateConversation) -> dict[str, Any]:
        cid = new_id("conv")
        data = {"conversationId": cid, "settings": body.settings.model_dump()}
        if body.title:
            data["title"] = body.title
        await backends.append(f"conversation:{cid}", [new_event("ConversationCreated", data)], expected=0)
        return {"id": cid, "settings": data["settings"]}

    @api.post("/conversations/{conversation_id}/attachments", status_code=201)
    async def upload_attachment(conversation_id: str, file: UploadFile = File(...)) -> dict[str, Any]:
        await conversation_settings(conversation_id)
        async def pieces():
            # streamed to the blob store in chunks: an attachment of any size in bounded memory
            while piece := await file.read(256 * 1024):
                yield piece

        media = file.content_type or "text/plain"
        stored = await backends.attach(conversation_id, file.filename or "attachment.txt", pieces(), media)
        attachment = {k: stored[k] for k in ("sha256", "handle", "displayName", "mediaType", "size", "uri")}
        await backends.append(f"conversation:{conversation_id}",
                              [new_event("AttachmentAdded", {"attachment": attachment})])
        return attachment

    @api.post("/conversations/{conversation_id}/turns", status_code=202)
    async def create_turn(conversation_id: str, body: CreateTurn) -> dict[str, Any]:
        cs = await conversation_settings(conversation_id)
        provider = provider_for(body.provider)
        hist = await backends.history(conversation_id)
        parent = hist["messages"][-1]["id"] if hist["messages"] else None
        turn_id, msg_id = new_id("turn"), new_id("msg")
        message = {"id": msg_id, "parentId": parent, "role": "user", "parts": [{"type": "text", "text": body.text}]}
        await backends.append(f"conversation:{conversation_id}", [new_event("UserMessageAdded", {"message": message})])
        task = asyncio.create_task(runner.run(conversation_id, turn_id, msg_id, provider, cs))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return {"turnId": turn_id, "userMessageId": msg_id,
                "events": f"/v1/conversations/{conversation_id}/turns/{turn_id}/events"}

    @api.get("/conversations/{conversation_id}/turns/{turn_id}/events")
    async def turn_events(conversation_id: str, turn_id: str, request: Request,
                          last_event_id: str | None = Header(None)) -> EventSourceResponse:
        start = int(last_event_id) + 1 if last_event_id and last_event_id.isdigit() else 1

        async def stream():
            nxt = start
            while not await request.is_disconnected():
                page = await backends.read_stream(f"turn:{turn_id}", nxt)
                for ev in page["events"]:
                    nxt = ev["version"] + 1
                    yield {"event": ev["type"], "id": str(ev["version"]), "data": json.dumps(ev["data"])}
                    if ev["type"] in TERMINAL:
                        return
                await asyncio.sleep(sse_poll_s)

        return EventSourceResponse(stream())

    @api.get("/conversations/{conversation_id}/turns/{turn_id}")
    async def turn_log(conversation_id: str, turn_id: str) -> dict[str, Any]:
        page = await backends.read_stream(f"turn:{turn_id}", 1)
        if not page["events"]:
            raise ServiceError(f"turn {turn_id} not found", code="not-found")
        return {"turnId": turn_id, "events": page["events"]}

    @api.get("/conversations/{conversation_id}/messages")
    async def messages(conversation_id: str) -> dict[str, Any]:
        await conversation_settings(conversation_id)
        return await backends.history(conversation_id)

    api.state_tasks = tasks  # type: ignore[attr-defined]
    return api


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, exc: ServiceError) -> JSONResponse:
        return error_response(exc)
