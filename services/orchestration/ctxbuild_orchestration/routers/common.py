"""What every route of the API shares: the path ids, the caller, the documented refusals, and the route class that
authenticates first and then reads a limited body."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Path, Request, Response
from fastapi.routing import APIRoute
from fastapi.security import APIKeyHeader, HTTPBearer
from starlette.types import Message

from ..adapters.auth import Authenticator, credential_of
from ..app.edge import EdgeLimits
from ..domain.keys import Principal
from .models import ApiError

# Path ids: what the service hands out (conv_…, turn_…, msg_…) and providers' tool call ids (call_…, toolu_…).
# No spaces, slashes, NUL, `%` or leading dot (so never `..`); capped, so a 5,000-char id is a 422, not a 502.
ID_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.:-]*$"
ID_MAX_CHARS = 128
ConversationId = Annotated[str, Path(max_length=ID_MAX_CHARS, pattern=ID_PATTERN, description="conv_…")]
TurnId = Annotated[str, Path(max_length=ID_MAX_CHARS, pattern=ID_PATTERN, description="turn_…")]
MessageId = Annotated[str, Path(max_length=ID_MAX_CHARS, pattern=ID_PATTERN, description="msg_…")]
ToolCallId = Annotated[str, Path(max_length=ID_MAX_CHARS, pattern=ID_PATTERN, description="the tool call's id")]

ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ApiError, "description": "unauthenticated: no credential, or an invalid, revoked or expired one"},
    404: {"model": ApiError, "description": "not found"},
    413: {"model": ApiError, "description": "the body or a field is over this server's limit (too-large)"},
    422: {"model": ApiError, "description": "invalid input: shape, NUL characters, lone surrogates, malformed ids"},
    429: {"model": ApiError, "description": "rate-limited: over the credential's requests per second or running "
                                            "turns (Retry-After)"},
}
TURN_CONFLICT: dict[int | str, dict[str, Any]] = {
    409: {"model": ApiError, "description": "turn-in-progress: the conversation's previous turn has not ended"}}


class BodyTooLarge(HTTPException):
    """Raised by the counting receive: FastAPI lets an HTTPException from body reading through as it is."""

    def __init__(self, limit: int, setting: str) -> None:
        super().__init__(413, f"the request body is over {limit:,} bytes, this server's limit (CTX_{setting})")


def body_limited_route(limits: EdgeLimits, auth: Authenticator | None = None) -> type[APIRoute]:
    """Routes that authenticate first, then read a limited body. The credential is verified and its rate
    checked before anything else (401/429: nothing about the route, its ids or the body is looked at for an
    unauthenticated caller); then a declared Content-Length over the limit is refused before reading anything, a
    chunked body as soon as the count passes it (413 ``too-large``, never the whole body in memory first).
    Attachments stream to the blob store and have their own, larger limit."""

    class BodyLimitedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Any]:
            handler = super().get_route_handler()
            attachments = self.path.endswith("/attachments")
            limit = limits.attachment_bytes if attachments else limits.body_bytes
            setting = "MAX_ATTACHMENT_BYTES" if attachments else "MAX_BODY_BYTES"

            async def limited(request: Request) -> Response:
                if auth is not None:
                    who = await auth.authenticate(credential_of(request))
                    await auth.check_rate(who)
                    request.scope.setdefault("state", {})["principal"] = who
                declared = request.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > limit:
                    raise BodyTooLarge(limit, setting)
                received = 0
                receive = request.receive

                async def counting() -> Message:
                    nonlocal received
                    message = await receive()
                    if message["type"] == "http.request":
                        received += len(message.get("body", b""))
                        if received > limit:
                            raise BodyTooLarge(limit, setting)
                    return message

                # the route reads the body through the counting receive (it never sends on its own: the response
                # is sent by the caller of this handler)
                return await handler(Request(request.scope, counting))

            return limited

    return BodyLimitedRoute


_BEARER = HTTPBearer(auto_error=False, description="an API key (ctx_…) or an OIDC access token")
_API_KEY = APIKeyHeader(name="x-api-key", auto_error=False, description="an API key (ctx_…)")


async def caller(request: Request, _bearer: Annotated[Any, Depends(_BEARER)],
                 _key: Annotated[Any, Depends(_API_KEY)]) -> Principal:
    """The authenticated caller (verified by the route class before the body is read)."""
    return request.state.principal


Caller = Annotated[Principal, Depends(caller)]
