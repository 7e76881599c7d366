"""The drop-in gateway (SPEC §15.5): ``POST /v1/chat/completions`` (OpenAI), ``POST /v1/messages`` (Anthropic),
``GET /v1/models``. Authenticated like every ``/v1`` route (Bearer or x-api-key, first), but every refusal —
authentication and rate limits included — is in the dialect's own error shape and status, never the API's
``{code, message, retryable}``. Thin: parse (domain/gateway), call app/gateway.py, encode."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import structlog
from ctxbuild_platform.errors import RemoteError, ServiceError
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..adapters.auth import Authenticator
from ..app.edge import EdgeLimits, safe_text
from ..app.gateway import Finished, Gateway, Started
from ..domain.gateway import (
    AnthropicStream,
    DialectError,
    GatewayRequest,
    OpenAIStream,
    anthropic_error,
    anthropic_error_type,
    anthropic_message,
    openai_completion,
    openai_error,
    openai_error_type,
    parse_anthropic,
    parse_openai,
    sse_comment,
)
from ..domain.keys import Principal
from .common import body_limited_route
from .errors import STATUS

log = structlog.get_logger("gateway")
CONVERSATION_HEADER = "x-ctx-conversation-id"
OPENAI_CODES = {401: "invalid_api_key", 404: "model_not_found", 409: "conversation_busy",
                429: "rate_limit_exceeded"}


def dialect_of(path: str) -> str:
    return "anthropic" if path.rstrip("/").endswith("/messages") else "openai"


def error_body(dialect: str, status: int, message: str, type_: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    if dialect == "anthropic":
        return anthropic_error(status, type_ or anthropic_error_type(status), message)
    return openai_error(status, type_ or openai_error_type(status), message, param, OPENAI_CODES.get(status))


def error_status(exc: ServiceError) -> int:
    if isinstance(exc, RemoteError):  # invalid-payload: what the client sent cannot be stored (400)
        return {"not-found": 404, "version-conflict": 409, "invalid-payload": 400}.get(
            exc.code, 503 if exc.retryable else 502)
    return STATUS.get(exc.code, 503 if exc.retryable else 500)


def dialect_refusal(dialect: str, exc: Exception) -> JSONResponse:
    """Any refusal of a gateway route in its dialect's error shape."""
    headers: dict[str, str] | None = None
    param = None
    type_ = None
    if isinstance(exc, DialectError):
        status, message, type_, param = exc.status, exc.message, exc.type, exc.param
    elif isinstance(exc, StarletteHTTPException):
        status, message = exc.status_code, safe_text(exc.detail)
        headers = getattr(exc, "headers", None)
    elif isinstance(exc, ServiceError):
        status, message = error_status(exc), safe_text(exc.message)
    else:
        raise exc
    return JSONResponse(error_body(dialect, status, message, type_, param), status_code=status, headers=headers)


def gateway_route(limits: EdgeLimits, auth: Authenticator) -> type[APIRoute]:
    """The API's route class (authenticate first, then a limited body), its refusals worded per dialect."""
    base = body_limited_route(limits, auth)

    class GatewayRoute(base):  # type: ignore[misc, valid-type]
        def get_route_handler(self) -> Callable[[Request], Any]:
            handler = super().get_route_handler()
            dialect = dialect_of(self.path)

            async def answering(request: Request) -> Response:
                try:
                    return await handler(request)
                except (DialectError, StarletteHTTPException, ServiceError) as exc:
                    return dialect_refusal(dialect, exc)

            return answering

    return GatewayRoute


async def json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise DialectError(400, "invalid_request_error", f"the body is not valid JSON: {exc}"[:300]) from exc


def build_gateway(gateway: Gateway, limits: EdgeLimits, auth: Authenticator) -> APIRouter:
    api = APIRouter(prefix="/v1", route_class=gateway_route(limits, auth), tags=["gateway"])

    @api.get("/models")
    async def models(request: Request) -> JSONResponse:
        """The model table with each model's context window: OpenAI's list shape, or Anthropic's when the
        request carries ``anthropic-version``."""
        entries = gateway.listing()
        if request.headers.get("anthropic-version"):
            data = [{"type": "model", "id": m.name, "display_name": m.name, "created_at": "1970-01-01T00:00:00Z",
                     "context_window": m.context_window} for m in entries]
            return JSONResponse({"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
                                 "last_id": data[-1]["id"] if data else None})
        return JSONResponse({"object": "list", "data": [
            {"id": m.name, "object": "model", "created": 0, "owned_by": m.owned_by,
             "context_window": m.context_window} for m in entries]})

    @api.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        """OpenAI Chat Completions, streamed (SSE ``chat.completion.chunk``) or not; ctxbuild's context
        management behind it. Headers: X-Ctx-Conversation-Id, X-Ctx-Turn-Id, X-Ctx-Served-Tokens,
        X-Ctx-Overhead-Ms (streamed: the last two as a final SSE comment)."""
        return await serve(gateway, request, parse_openai(await json_body(request)))

    @api.post("/messages")
    async def messages(request: Request) -> Response:
        """Anthropic Messages, streamed (SSE events) or not; ctxbuild's context management behind it."""
        return await serve(gateway, request, parse_anthropic(await json_body(request)))

    return api


def explicit_conversation(request: Request, req: GatewayRequest) -> None:
    header = request.headers.get(CONVERSATION_HEADER)
    if header:
        req.conversation_id = header


async def serve(gateway: Gateway, request: Request, req: GatewayRequest) -> Response:
    who: Principal = request.state.principal
    explicit_conversation(request, req)
    started = await gateway.start(who, req)
    if req.stream:
        return StreamingResponse(stream(gateway, who, started), media_type="text/event-stream",
                                 headers={**gateway.headers(started), "Cache-Control": "no-cache"})
    try:
        async for _ in gateway.wait_end(started):
            pass
        finished = await gateway.finish(started)
    except BaseException:
        await started.watch.close()
        raise
    if finished.result is None:
        err = finished.error or {}
        return JSONResponse(error_body(req.dialect, err["status"], err["message"]), status_code=err["status"],
                            headers=gateway.headers(started, finished))
    rid = response_id(req.dialect, started.turn_id)
    body = (anthropic_message(finished.result, id=rid, model=req.model) if req.dialect == "anthropic" else
            openai_completion(finished.result, id=rid, model=req.model, created=int(time.time())))
    return JSONResponse(body, headers=gateway.headers(started, finished))


def response_id(dialect: str, turn_id: str) -> str:
    tail = turn_id.removeprefix("turn_")
    return f"msg_{tail}" if dialect == "anthropic" else f"chatcmpl-{tail}"


async def stream(gateway: Gateway, who: Principal, started: Started) -> AsyncIterator[bytes]:
    """Text deltas as the model writes them (a blank line between two steps' texts), then the client's calls,
    the finish reason and the usage; ctxbuild's served tokens and overhead as an SSE comment before the end."""
    req = started.request
    rid = response_id(req.dialect, started.turn_id)
    enc: Any = (AnthropicStream(id=rid, model=req.model) if req.dialect == "anthropic" else
                OpenAIStream(id=rid, model=req.model, created=int(time.time()), include_usage=req.include_usage))
    ended = False
    try:
        for chunk in enc.start():
            yield chunk
        step, said = None, False
        async for d in gateway.wait_end(started):
            if d.get("ping"):
                for chunk in enc.ping():
                    yield chunk
                continue
            if d["step"] != step:
                step = d["step"]
                if said and d["text"]:
                    for chunk in enc.text("\n\n"):
                        yield chunk
            if d["text"]:
                said = True
                for chunk in enc.text(d["text"]):
                    yield chunk
        finished: Finished = await gateway.finish(started)
        ended = True
        h = gateway.headers(started, finished)
        yield sse_comment(f"x-ctx-served-tokens={h['X-Ctx-Served-Tokens']} "
                          f"x-ctx-overhead-ms={h['X-Ctx-Overhead-Ms']}")
        if finished.result is None:
            err = finished.error or {}
            etype = (anthropic_error_type if req.dialect == "anthropic" else openai_error_type)(err["status"])
            for chunk in enc.error(err["status"], etype, err["message"]):
                yield chunk
        else:
            for chunk in enc.finish(finished.result):
                yield chunk
    except ServiceError as exc:
        status = error_status(exc)
        etype = (anthropic_error_type if req.dialect == "anthropic" else openai_error_type)(status)
        for chunk in enc.error(status, etype, safe_text(exc.message)):
            yield chunk
    finally:
        await started.watch.close()
        if not ended:  # the client went away (or the wait failed): the turn must not hold the conversation
            gateway.abort_later(who, started, "the gateway client disconnected")
