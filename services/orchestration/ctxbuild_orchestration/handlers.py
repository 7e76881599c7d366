"""HTTP/SSE edge (FastAPI). Thin: validate, hand to the backends or the runner, map typed errors to HTTP."""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import structlog
from ctxbuild_blobclient import content_ref
from ctxbuild_platform import contracts
from ctxbuild_platform.errors import InvalidPayload, RemoteError, ServiceError
from ctxbuild_platform.text import first_bad_text
from fastapi import (
    APIRouter,
    Depends,
    FastAPI,
    File,
    Header,
    HTTPException,
    Path,
    Query,
    Request,
    Response,
    UploadFile,
)
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import APIKeyHeader, HTTPBearer
from opentelemetry.propagate import inject
from pydantic import BaseModel, Field, model_validator
from pydantic_core import PydanticCustomError
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message

from .adapters import content
from .adapters.backends import Backends, new_event
from .adapters.work_queue import ABORT_SUBJECT, TurnQueue
from .auth import (
    KEY_INDEX,
    KEY_STREAM,
    LEGACY_TENANT,
    TENANT_PATTERN,
    Authenticator,
    Principal,
    credential_of,
    new_key,
)
from .domain.results import full_output
from .domain.turn_state import event_id, fold
from .runner import DELTA_SUBJECT, keep_finished_steps, new_id

log = structlog.get_logger("edge")

TERMINAL = {"TurnCompleted", "TurnFailed"}
STATUS = {"invalid-payload": 422, "not-found": 404, "version-conflict": 409, "unavailable": 503, "timeout": 504,
          "provider-not-configured": 400, "unsupported-media": 415, "conflict": 409,
          "too-large": 413, "turn-in-progress": 409}
# FastAPI/Starlette's own refusals (unknown route, wrong method, body over its limit, unparsable body), worded
# in the API's error shape
HTTP_CODES = {400: "invalid-payload", 401: "unauthenticated", 403: "forbidden", 404: "not-found",
              405: "method-not-allowed", 413: "too-large", 415: "unsupported-media", 422: "invalid-payload",
              429: "rate-limited"}
REPLAY_INLINE_MAX_BYTES = 32 * 1024  # a larger replay script goes to the blob store with the turn (events stay small)

# Path ids: what the service hands out (conv_…, turn_…, msg_…) and providers' tool call ids (call_…, toolu_…).
# No spaces, slashes, NUL, `%` or leading dot (so never `..`); capped, so a 5,000-char id is a 422, not a 502.
ID_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.:-]*$"
ID_MAX_CHARS = 128
ConversationId = Annotated[str, Path(max_length=ID_MAX_CHARS, pattern=ID_PATTERN, description="conv_…")]
TurnId = Annotated[str, Path(max_length=ID_MAX_CHARS, pattern=ID_PATTERN, description="turn_…")]
MessageId = Annotated[str, Path(max_length=ID_MAX_CHARS, pattern=ID_PATTERN, description="msg_…")]
ToolCallId = Annotated[str, Path(max_length=ID_MAX_CHARS, pattern=ID_PATTERN, description="the tool call's id")]

# one running turn per conversation: the admissions stream (event TurnAdmitted, appended with expected version)
ADMISSIONS_PREFIX = "conversation-turns:"
# an admitted turn with no event yet after this long was abandoned by a crashed edge: it no longer holds the lock
ADMISSION_GRACE_S = 60.0
# an abort of a running turn: the runner holding it ends it at once (wake-up) or at its next write; a turn whose
# runner is gone is ended by the edge after this long (the same terminal event id: still exactly one)
ABORT_GRACE_S = 10.0

@dataclass(frozen=True)
class EdgeLimits:
    """Input limits of the HTTP edge (Settings ``max_*``): over one → 413 naming the limit."""

    body_bytes: int = 64 * 1024 * 1024
    attachment_bytes: int = 4 * 1024 * 1024 * 1024
    title_chars: int = 1000
    turn_text_bytes: int = 8 * 1024 * 1024
    replay_script_bytes: int = 48 * 1024 * 1024
    attachment_name_chars: int = 255

    @classmethod
    def from_settings(cls, settings: Any) -> EdgeLimits:
        return cls(body_bytes=settings.max_body_bytes, attachment_bytes=settings.max_attachment_bytes,
                   title_chars=settings.max_title_chars, turn_text_bytes=settings.max_turn_text_bytes,
                   replay_script_bytes=settings.max_replay_script_bytes,
                   attachment_name_chars=settings.max_attachment_name_chars)


def bad_text_at(value: Any, where: str) -> str | None:
    """Where the first NUL character or lone surrogate is in a JSON value (keys included), or None. Neither can
    be stored and read back as text (Postgres text refuses NUL, UTF-8 has no surrogates)."""
    found = first_bad_text(value, where)
    if found is None:
        return None
    if found.in_key:
        return f"a key of {found.path} holds a NUL character or a lone surrogate"
    return f"{found.path} holds {found.describe()} at index {found.index}"


class RequestBody(BaseModel):
    """A request body: every string in it (keys too) is text that can be stored, at any depth."""

    @model_validator(mode="before")
    @classmethod
    def _storable_text(cls, data: Any) -> Any:
        if (found := bad_text_at(data, "body")) is not None:
            raise PydanticCustomError("unstorable_text", "{problem}, which is not accepted", {"problem": found})
        return data


class ConversationSettings(BaseModel):
    contextWindow: int | None = Field(None, gt=0, description="model context window in tokens; null = unknown")
    reservation: int | None = Field(None, ge=0)
    truncateThreshold: int | None = Field(None, ge=2000)
    maxMessages: int | None = Field(None, ge=1)
    compressEnabled: bool = True
    mcpMode: Literal["manual", "auto", "disabled"] = "manual"
    mcpServers: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(default_factory=list,
                                                                                 max_length=100)
    webTools: bool = Field(True, description="offer the deployment's web tools (web_fetch, web_search) to the model")
    summarizer: Literal["extractive", "llm", "masking"] | None = Field(
        None, description="which summarizer folds (SPEC §10); null = the compaction service's default")


class CreateConversation(RequestBody):
    title: str | None = None
    settings: ConversationSettings = Field(default_factory=ConversationSettings)


class RecordedTool(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    description: str = ""
    inputSchema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class ReplaySpec(BaseModel):
    """Scripted or recorded model decisions (offline runs, demos, tests, trajectory replays). A step's
    toolCalls may carry a recorded `output`; `tools` are the recorded tools the turn offers."""

    kind: Literal["replay"]
    script: list[dict[str, Any]] = Field(min_length=1)
    tools: list[RecordedTool] = Field(default_factory=list)


class OpenAISpec(BaseModel):
    """A real model behind the server's configured OpenAI-compatible endpoint (CTX_OPENAI_BASE_URL/API_KEY)."""

    kind: Literal["openai"]
    model: str = Field(min_length=1, max_length=256)


class AnthropicSpec(BaseModel):
    """A Claude model through the Messages API (CTX_ANTHROPIC_API_KEY, optional CTX_ANTHROPIC_BASE_URL)."""

    kind: Literal["anthropic"]
    model: str = Field(min_length=1, max_length=256)


ProviderSpec = Annotated[ReplaySpec | OpenAISpec | AnthropicSpec, Field(discriminator="kind")]


class CreateTurn(RequestBody):
    text: str = Field(min_length=1)
    provider: ProviderSpec
    maxSteps: int | None = Field(None, ge=1, description="model calls this turn may make (default: the server's)")


class Regenerate(RequestBody):
    provider: ProviderSpec | None = Field(None, description="default: the regenerated turn's provider")
    maxSteps: int | None = Field(None, ge=1)


class Abort(RequestBody):
    reason: str | None = Field(None, max_length=500)


def error_response(exc: ServiceError) -> JSONResponse:
    if isinstance(exc, RemoteError):
        # a backend refusing our own request is our fault (502), not the client's (422)
        status = {"not-found": 404, "version-conflict": 409}.get(exc.code, 503 if exc.retryable else 502)
    else:
        status = STATUS.get(exc.code, 500)
    return JSONResponse(exc.to_payload(), status_code=status)


def terminal_failure(turn_id: str, data: dict[str, Any]) -> dict[str, Any]:
    """A TurnFailed with the turn's one terminal event id (as the runner's): written twice, stored once."""
    return {"eventId": event_id(turn_id, "terminal"), "type": "TurnFailed", "data": data}


def too_large(what: str, size: int, limit: int, unit: str, setting: str) -> ServiceError:
    return ServiceError(f"{what} is {size:,} {unit}; this server accepts at most {limit:,} (CTX_{setting})",
                        code="too-large", details={"size": size, "limit": limit})


class ApiError(BaseModel):
    """Every refusal of the API (typed service errors, request validation, the framework's own)."""

    code: str = Field(description="invalid-payload, not-found, too-large, turn-in-progress, …")
    message: str = Field(description="what was refused and why, for a person")
    retryable: bool


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
                    auth.check_rate(who)
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

                return await handler(Request(request.scope, counting, request._send))

            return limited

    return BodyLimitedRoute


_BEARER = HTTPBearer(auto_error=False, description="an API key (ctx_…) or an OIDC access token")
_API_KEY = APIKeyHeader(name="x-api-key", auto_error=False, description="an API key (ctx_…)")


async def caller(request: Request, _bearer: Annotated[Any, Depends(_BEARER)],
                 _key: Annotated[Any, Depends(_API_KEY)]) -> Principal:
    """The authenticated caller (verified by the route class before the body is read)."""
    return request.state.principal


Caller = Annotated[Principal, Depends(caller)]


def conversation_not_found(conversation_id: str) -> ServiceError:
    """The one answer for a conversation that does not exist and for another tenant's (no oracle)."""
    return ServiceError(f"conversation {conversation_id} not found", code="not-found")


class CreateKey(RequestBody):
    tenantId: str = Field(min_length=1, max_length=128, pattern=TENANT_PATTERN)
    name: str | None = Field(None, max_length=200)
    admin: bool = Field(False, description="may manage keys (/v1/keys)")
    requestsPerSecond: int | None = Field(None, ge=1, le=100_000, description="default: the server's")
    maxRunningTurns: int | None = Field(None, ge=1, le=10_000, description="default: the server's")


def build_api(backends: Backends, queue: TurnQueue, sse_poll_s: float,
              check_provider: Callable[[dict[str, Any]], None], max_steps_limit: int,
              limits: EdgeLimits = EdgeLimits(), auth: Authenticator | None = None,
              abort_grace_s: float = ABORT_GRACE_S) -> APIRouter:
    if auth is None:
        raise ValueError("the API needs an Authenticator")
    watchdogs: set[asyncio.Task] = set()  # held: an unreferenced task may be collected before it runs
    api = APIRouter(prefix="/v1", route_class=body_limited_route(limits, auth), responses=ERRORS,
                    dependencies=[Depends(caller)])

    async def conversation_settings(conversation_id: str, who: Principal) -> dict[str, Any]:
        """The conversation's settings, if it exists and belongs to the caller's tenant (else the same 404)."""
        first = await backends.read_stream(f"conversation:{conversation_id}", 1, limit=1)
        if not first["events"] or first["events"][0]["type"] != "ConversationCreated":
            raise conversation_not_found(conversation_id)
        data = first["events"][0]["data"]
        if not hmac.compare_digest(str(data.get("tenantId", LEGACY_TENANT)).encode(), who.tenant.encode()):
            raise conversation_not_found(conversation_id)
        return data.get("settings", {})

    async def turn_state(conversation_id: str, turn_id: str, who: Principal):
        await conversation_settings(conversation_id, who)
        return await turn_of(conversation_id, turn_id)

    async def turn_of(conversation_id: str, turn_id: str):
        """A turn of a conversation whose ownership the caller has checked."""
        events = await backends.read_stream_all(f"turn:{turn_id}")
        st = fold(turn_id, events)
        if st.command is None or st.command.get("conversationId") != conversation_id:
            raise ServiceError(f"turn {turn_id} not found in conversation {conversation_id}", code="not-found")
        return st, events

    def checked_provider(spec: BaseModel) -> tuple[dict[str, Any], bytes | None]:
        """The provider spec as data (and a replay script's JSON), refused early: not configured, over the limit."""
        data = spec.model_dump(exclude_none=True)
        check_provider(data)
        if data["kind"] != "replay":
            return data, None
        raw = json.dumps({"script": data["script"], "tools": data.get("tools", [])}, ensure_ascii=False).encode()
        if (size := len(raw)) > limits.replay_script_bytes:
            raise too_large("the replay script", size, limits.replay_script_bytes, "bytes of JSON",
                            "MAX_REPLAY_SCRIPT_BYTES")
        return data, raw

    async def provider_payload(conversation_id: str, turn_id: str, checked: tuple[dict[str, Any], bytes | None]
                               ) -> dict[str, Any]:
        """The provider as the turn command records it: never a secret; a large replay script by reference."""
        data, raw = checked
        if raw is not None and len(raw) > REPLAY_INLINE_MAX_BYTES:
            stored = await backends.blobs.put(raw, conversation_id, content.turn_owner(turn_id), content.KEPT,
                                              media_type="application/json")
            return {"kind": "replay", "scriptRef": {"sha256": stored["sha256"], "size": stored["size"]}}
        return data

    def check_max_steps(max_steps: int | None) -> None:
        if max_steps is not None and max_steps > max_steps_limit:
            raise ServiceError(f"maxSteps {max_steps} is above this server's limit {max_steps_limit}",
                               code="invalid-payload")

    async def enqueue(conversation_id: str, turn_id: str, user_message_id: str, provider: dict[str, Any],
                      settings: dict[str, Any], max_steps: int | None, regenerate_of: str | None = None) -> None:
        carrier: dict[str, str] = {}
        inject(carrier)  # the turn continues this request's trace on whichever replica runs it
        cmd = {"turnId": turn_id, "conversationId": conversation_id, "userMessageId": user_message_id,
               "provider": provider, "settings": settings, "trace": carrier}
        if max_steps is not None:
            cmd["maxSteps"] = max_steps
        if regenerate_of:
            cmd["regenerateOf"] = regenerate_of
        await backends.append(f"turn:{turn_id}", [new_event("TurnQueued", cmd)], expected=0)
        try:
            await queue.submit(turn_id, conversation_id)
        except Exception as exc:
            await backends.append(f"turn:{turn_id}", [terminal_failure(turn_id, {
                "turnId": turn_id, "code": "unavailable", "message": "the work queue refused the turn",
                "retryable": True})])
            raise ServiceError(f"the work queue is unavailable: {exc}", code="unavailable", retryable=True) from exc

    async def stream_tail(stream: str) -> tuple[int, dict[str, Any] | None]:
        """A stream's version and its last event (two small reads at most, whatever the stream's length)."""
        head = await backends.read_stream(stream, 1, limit=1)
        last = head["lastVersion"]
        if not last:
            return 0, None
        page = head if last == 1 else await backends.read_stream(stream, last, limit=1)
        return last, (page["events"][0] if page["events"] else None)

    async def still_running(admitted: dict[str, Any]) -> bool:
        """Has the turn of an admission not ended yet? (No event yet: being queued right now, unless abandoned.)"""
        _, latest = await stream_tail(f"turn:{admitted['data']['turnId']}")
        if latest is None:
            at = datetime.fromisoformat(admitted["recordedAt"])
            return (datetime.now(UTC) - at).total_seconds() < ADMISSION_GRACE_S
        return latest["type"] not in TERMINAL

    async def admit(conversation_id: str, turn_id: str, user_message_id: str,
                    regenerate_of: str | None = None) -> None:
        """One running turn per conversation (SPEC §15.3), race-free: the previous admission's turn must have
        ended, and the new admission is appended with the admissions stream's expected version — of concurrent
        requests exactly one is admitted, the others get 409."""
        stream = ADMISSIONS_PREFIX + conversation_id
        version, previous = await stream_tail(stream)
        if previous is not None and await still_running(previous):
            raise turn_in_progress(conversation_id, previous["data"]["turnId"])
        data = {"turnId": turn_id, "userMessageId": user_message_id}
        if regenerate_of:
            data["regenerateOf"] = regenerate_of
        try:
            await backends.append(stream, [new_event("TurnAdmitted", data)], expected=version)
        except RemoteError as exc:
            if exc.code == "version-conflict":  # another request was admitted between our read and our append
                raise turn_in_progress(conversation_id, None) from exc
            raise

    async def admit_for(who: Principal, conversation_id: str, turn_id: str, user_message_id: str,
                        regenerate_of: str | None = None) -> None:
        """The caller's running-turn limit (429), then the conversation's one running turn (409)."""
        async def running(t: str) -> bool:
            _, latest = await stream_tail(f"turn:{t}")
            return latest is None or latest["type"] not in TERMINAL

        await auth.admit_turn(who, turn_id, running)
        try:
            await admit(conversation_id, turn_id, user_message_id, regenerate_of)
        except BaseException:
            auth.turn_not_started(who, turn_id)
            raise

    async def abandon(turn_id: str, exc: BaseException) -> None:
        """An admitted turn that could not be queued ends at once (its admission no longer holds the lock)."""
        try:
            await backends.append(f"turn:{turn_id}", [terminal_failure(turn_id, {
                "turnId": turn_id, "code": "not-queued", "retryable": True,
                "message": f"the turn was admitted but could not be queued: {type(exc).__name__}"})])
        except Exception as err:  # noqa: BLE001 - the admission's grace period frees the conversation instead
            log.warning("turn-not-abandoned", turn_id=turn_id, error=_safe(err))

    def accepted(conversation_id: str, turn_id: str, user_message_id: str) -> dict[str, Any]:
        return {"turnId": turn_id, "userMessageId": user_message_id,
                "events": f"/v1/conversations/{conversation_id}/turns/{turn_id}/events"}

    @api.post("/conversations", status_code=201)
    async def create_conversation(body: CreateConversation, who: Caller) -> dict[str, Any]:
        if body.title and len(body.title) > limits.title_chars:
            raise too_large("the title", len(body.title), limits.title_chars, "characters", "MAX_TITLE_CHARS")
        cid = new_id("conv")
        data = {"conversationId": cid, "tenantId": who.tenant, "settings": body.settings.model_dump()}
        if body.title:
            data["title"] = body.title
        await backends.append(f"conversation:{cid}", [new_event("ConversationCreated", data)], expected=0)
        return {"id": cid, "settings": data["settings"]}

    @api.post("/conversations/{conversation_id}/attachments", status_code=201)
    async def upload_attachment(conversation_id: ConversationId,
                                file: Annotated[UploadFile, File()], who: Caller) -> dict[str, Any]:
        name = file.filename or "attachment.txt"
        if (found := bad_text_at(name, "the file name")) is not None:
            raise ServiceError(f"{found}, which is not accepted", code="invalid-payload")
        if len(name) > limits.attachment_name_chars:
            raise too_large("the file name", len(name), limits.attachment_name_chars, "characters",
                            "MAX_ATTACHMENT_NAME_CHARS")
        media = file.content_type or "text/plain"
        if len(media) > 255 or bad_text_at(media, "the media type") is not None:
            raise ServiceError("the part's Content-Type is not a media type", code="invalid-payload")
        await conversation_settings(conversation_id, who)
        async def pieces():
            # streamed to the blob store in chunks: an attachment of any size in bounded memory
            while piece := await file.read(256 * 1024):
                yield piece

        stored = await backends.attach(conversation_id, name, pieces(), media)
        attachment = {k: stored[k] for k in ("sha256", "handle", "displayName", "mediaType", "size", "uri")}
        await backends.append(f"conversation:{conversation_id}",
                              [new_event("AttachmentAdded", {"attachment": attachment})])
        return attachment

    @api.post("/conversations/{conversation_id}/turns", status_code=202, responses=TURN_CONFLICT)
    async def create_turn(conversation_id: ConversationId, body: CreateTurn, who: Caller) -> dict[str, Any]:
        """409 ``turn-in-progress`` while the conversation's previous turn has not ended (one running turn per
        conversation); the user message hangs under the conversation's latest message."""
        if (size := len(body.text.encode())) > limits.turn_text_bytes:
            raise too_large("the turn text", size, limits.turn_text_bytes, "bytes", "MAX_TURN_TEXT_BYTES")
        check_max_steps(body.maxSteps)
        cs = await conversation_settings(conversation_id, who)
        checked = checked_provider(body.provider)
        turn_id, msg_id = new_id("turn"), new_id("msg")
        await admit_for(who, conversation_id, turn_id, msg_id)
        try:
            provider = await provider_payload(conversation_id, turn_id, checked)
            hist = await backends.history(conversation_id)
            parent = hist["messages"][-1]["id"] if hist["messages"] else None
            message = {"id": msg_id, "parentId": parent, "role": "user",
                       "parts": [{"type": "text", "text": body.text}]}
            # large parts by reference (the event stays small), owned by the conversation: never collected
            message = await content_ref.store_message_parts(backends.blobs, message, conversation_id,
                                                            ("conversation", conversation_id), "tool_output")
            await backends.append(f"conversation:{conversation_id}",
                                  [new_event("UserMessageAdded", {"message": message})])
            await enqueue(conversation_id, turn_id, msg_id, provider, cs, body.maxSteps)
        except BaseException as exc:
            await asyncio.shield(abandon(turn_id, exc))
            raise
        return accepted(conversation_id, turn_id, msg_id)

    @api.post("/conversations/{conversation_id}/turns/{turn_id}/regenerate", status_code=202,
              responses=TURN_CONFLICT)
    async def regenerate(conversation_id: ConversationId, turn_id: TurnId,
                         who: Caller, body: Regenerate | None = None) -> dict[str, Any]:
        """A new turn over the same user message: its answer is a sibling branch of the regenerated one. 409
        ``turn-in-progress`` while a turn of the conversation is running (the regenerated one included)."""
        body = body or Regenerate()
        cs = await conversation_settings(conversation_id, who)
        st, _ = await turn_of(conversation_id, turn_id)
        checked = checked_provider(body.provider) if body.provider else None
        new_turn = new_id("turn")
        cmd = st.command or {}
        max_steps = body.maxSteps if body.maxSteps is not None else cmd.get("maxSteps")
        check_max_steps(max_steps)
        await admit_for(who, conversation_id, new_turn, cmd["userMessageId"], regenerate_of=turn_id)
        try:
            provider = (await provider_payload(conversation_id, new_turn, checked) if checked
                        else cmd["provider"])
            await enqueue(conversation_id, new_turn, cmd["userMessageId"], provider, cs, max_steps,
                          regenerate_of=turn_id)
        except BaseException as exc:
            await asyncio.shield(abandon(new_turn, exc))
            raise
        return {**accepted(conversation_id, new_turn, cmd["userMessageId"]), "regenerateOf": turn_id}

    def aborted(turn_id: str, reason: str, how: str) -> dict[str, Any]:
        return terminal_failure(turn_id, {"turnId": turn_id, "code": "aborted", "retryable": False,
                                          "message": f"the turn was aborted ({how}): {reason}"})

    async def admitted_last(conversation_id: str, turn_id: str) -> bool:
        """Is ``turn_id`` the conversation's latest admission (the one that holds its turn lock)?"""
        _, latest = await stream_tail(ADMISSIONS_PREFIX + conversation_id)
        return latest is not None and latest["data"].get("turnId") == turn_id

    async def end_if_unended(turn_id: str, reason: str) -> None:
        """The backstop of an abort: after the grace, a turn still without a terminal event (its runner died, or
        its command was lost) is ended here."""
        await asyncio.sleep(abort_grace_s)
        try:
            _, latest = await stream_tail(f"turn:{turn_id}")
            if latest is None or latest["type"] not in TERMINAL:
                st = fold(turn_id, await backends.read_stream_all(f"turn:{turn_id}"))
                await keep_finished_steps(backends, st, "aborted")  # as the runner would have (SPEC §15.4)
                await backends.append(f"turn:{turn_id}", [aborted(turn_id, reason, "no runner ended it")])
                log.warning("abort-ended-by-edge", turn_id=turn_id)
        except Exception as exc:  # noqa: BLE001 - the redelivered command reads TurnAbortRequested and ends it
            log.warning("abort-backstop-failed", turn_id=turn_id, error=_safe(exc))

    @api.post("/conversations/{conversation_id}/turns/{turn_id}/abort", status_code=202)
    async def abort(conversation_id: ConversationId, turn_id: TurnId, who: Caller,
                    body: Abort | None = None) -> dict[str, Any]:
        """Any turn that has not ended can be aborted, and always ends with exactly one terminal event (SPEC
        §15.4), freeing the conversation's turn lock. Durable first (TurnAbortRequested, read by the runner at
        pick-up and when its next write finds it), then a wake-up for the replica running it. A turn no runner
        has started (queued, its command maybe lost) is ended here at once; an admitted turn that was never
        queued too; a started one is ended here after a grace if no runner did it."""
        await conversation_settings(conversation_id, who)
        reason = (body.reason if body else None) or "requested by the client"
        events = await backends.read_stream_all(f"turn:{turn_id}")
        st = fold(turn_id, events)
        if st.command is None or st.command.get("conversationId") != conversation_id:
            if st.command is None and await admitted_last(conversation_id, turn_id):
                if st.done:
                    raise ServiceError(f"turn {turn_id} already ended ({st.terminal['type']})", code="conflict")
                # admitted, never queued (the edge failed in between): holds the lock until it ends
                await backends.append(f"turn:{turn_id}", [aborted(turn_id, reason, "admitted, never queued")])
                return {"turnId": turn_id, "status": "aborted"}
            raise ServiceError(f"turn {turn_id} not found in conversation {conversation_id}", code="not-found")
        if st.done:
            raise ServiceError(f"turn {turn_id} already ended ({st.terminal['type']})", code="conflict")
        await backends.append(f"turn:{turn_id}", [new_event("TurnAbortRequested", {"turnId": turn_id,
                                                                                  "reason": reason})])
        if not st.started:  # no runner holds it: a runner picking it up now finds the end (or the abort)
            await backends.append(f"turn:{turn_id}", [aborted(turn_id, reason, "before it started")])
            return {"turnId": turn_id, "status": "aborted"}
        await backends.rpc.broker.publish({"turnId": turn_id, "reason": reason}, ABORT_SUBJECT)
        task = asyncio.create_task(end_if_unended(turn_id, reason), name=f"abort:{turn_id}")
        watchdogs.add(task)
        task.add_done_callback(watchdogs.discard)
        return {"turnId": turn_id, "status": "abort-requested"}

    @api.get("/conversations/{conversation_id}/turns/{turn_id}/events")
    async def turn_events(conversation_id: ConversationId, turn_id: TurnId, request: Request, who: Caller,
                          last_event_id: str | None = Header(None), deltas: bool = True) -> Response:
        """The turn's events as SSE (``id`` = version, resumable with ``Last-Event-ID``), ending with the terminal
        one. With ``deltas`` (default) the model's text also streams in as ``TextDelta`` events (no ``id``: live
        only, never replayed — the step's assistant message is the record)."""
        start = int(last_event_id) + 1 if last_event_id and last_event_id.isdigit() else 1
        st, _ = await turn_state(conversation_id, turn_id, who)
        if st.done and start > st.version:
            return Response(status_code=204)  # the turn ended and the client has seen every event: nothing to stream
        live: asyncio.Queue[bytes] = asyncio.Queue(maxsize=10_000)

        async def on_delta(msg: Any) -> None:
            try:
                contracts.validate("subjects/ctx.turn.delta.request.json", json.loads(msg.data))
                live.put_nowait(msg.data)
            except (ValueError, InvalidPayload, asyncio.QueueFull):
                pass  # a malformed or surplus delta is dropped: the events carry the text anyway

        async def stream():
            nxt = start
            sub = await backends.rpc.broker.connection.subscribe(f"{DELTA_SUBJECT}.{turn_id}", cb=on_delta) \
                if deltas and not st.done else None
            loop = asyncio.get_running_loop()
            try:
                while not await request.is_disconnected():
                    page = await backends.read_stream(f"turn:{turn_id}", nxt)
                    for ev in page["events"]:
                        nxt = ev["version"] + 1
                        ev = await content.present_event(backends.blobs, ev, conversation_id)
                        yield {"event": ev["type"], "id": str(ev["version"]), "data": json.dumps(ev["data"])}
                        if ev["type"] in TERMINAL:
                            return
                    deadline = loop.time() + sse_poll_s
                    while (left := deadline - loop.time()) > 0:
                        try:
                            data = await asyncio.wait_for(live.get(), left)
                        except TimeoutError:
                            break
                        yield {"event": "TextDelta", "data": data.decode()}
            finally:
                if sub is not None:
                    await sub.unsubscribe()

        return EventSourceResponse(stream())

    @api.get("/conversations/{conversation_id}/turns/{turn_id}")
    async def turn_log(conversation_id: ConversationId, turn_id: TurnId, who: Caller) -> dict[str, Any]:
        """Status and events; message parts, tool inputs and outputs held by reference are shown inline, a fold
        checkpoint's compacted prefix stays a reference (each step's served request shows what the model saw)."""
        st, events = await turn_state(conversation_id, turn_id, who)
        events = await content.present_events(backends.blobs, events, conversation_id)
        status = ("completed" if st.terminal and st.terminal["type"] == "TurnCompleted" else
                  "failed" if st.terminal else "running" if st.started else "queued")
        out: dict[str, Any] = {"turnId": turn_id, "status": status, "steps": len(st.steps), "events": events}
        if st.terminal and st.terminal["type"] == "TurnFailed":
            out["error"] = {k: st.terminal["data"].get(k) for k in ("code", "message", "retryable")}
        return out

    @api.get("/conversations/{conversation_id}/turns/{turn_id}/steps/{step}/request")
    async def served_request(conversation_id: ConversationId, turn_id: TurnId, who: Caller,
                             step: Annotated[int, Path(ge=0, le=1_000_000)]) -> Response:
        """The request of one step exactly as the model saw it (the bytes whose sha256 is StepServed.requestHash)."""
        _, events = await turn_state(conversation_id, turn_id, who)
        served = next((e["data"] for e in events if e["type"] == "StepServed" and e["data"]["step"] == step), None)
        if served is None:
            raise ServiceError(f"turn {turn_id} has no step {step}", code="not-found")
        ref = served.get("request")
        if not ref:
            raise ServiceError(f"step {step}'s request was not kept (CTX_KEEP_SERVED_REQUESTS off or the write "
                               "failed)", code="not-found")
        body = await backends.blobs.get_bytes(conversation_id, sha256=ref["sha256"])
        return Response(body, media_type="application/json",
                        headers={"X-Request-Hash": served["requestHash"], "ETag": f'"{served["requestHash"]}"'})

    @api.get("/conversations/{conversation_id}/messages")
    async def messages(conversation_id: ConversationId, who: Caller, branches: bool = False,
                       anchor: Annotated[str | None, Query(max_length=ID_MAX_CHARS, pattern=ID_PATTERN)] = None
                       ) -> dict[str, Any]:
        """The path from the root to ``anchor`` (default: the latest message); ``branches`` adds, for every path
        message with siblings (regenerated answers), the sibling ids — pass one as ``anchor`` to read that branch."""
        await conversation_settings(conversation_id, who)
        return await backends.history_all(conversation_id, anchor, branches)

    @api.get("/conversations/{conversation_id}/messages/{message_id}/results/{tool_call_id}")
    async def tool_result(conversation_id: ConversationId, message_id: MessageId,
                          tool_call_id: ToolCallId, who: Caller) -> dict[str, Any]:
        """A tool result read back in full for a UI: persisted envelopes are inflated by the blob store, in-flight
        offloads are read from their blobs; a result that was never trimmed is returned as stored."""
        await conversation_settings(conversation_id, who)
        # the path to the message (any branch) ends with the message itself
        hist = await backends.rpc.call("ctx.persist.history", {"conversationId": conversation_id,
                                                               "anchorId": message_id})
        msg = hist["messages"][-1] if hist["messages"] else None
        part = next((p for p in (msg or {}).get("parts", []) if p.get("type") == "tool-result"
                     and p.get("toolCallId") == tool_call_id), None)
        if part is None:
            raise ServiceError(f"no tool result {tool_call_id} in message {message_id}", code="not-found")
        return await full_output(backends, conversation_id, part)

    @api.get("/whoami", tags=["keys"])
    async def whoami(who: Caller) -> dict[str, Any]:
        """The authenticated caller: its tenant and whether it may manage keys."""
        return {"subject": who.subject, "tenantId": who.tenant, "admin": who.admin}

    # ---------- API keys (admin scope) ----------
    def admin_only(who: Principal) -> None:
        if not who.admin:
            raise HTTPException(403, "this credential has no admin scope (managing keys needs an admin key)")

    async def key_record(key_id: str) -> dict[str, Any] | None:
        events = await backends.read_stream_all(KEY_STREAM + key_id)
        issued = next((e for e in events if e["type"] == "ApiKeyIssued"), None)
        if issued is None:
            return None
        revoked = next((e for e in events if e["type"] == "ApiKeyRevoked"), None)
        d = issued["data"]
        return {"keyId": key_id, "tenantId": d["tenantId"], "name": d.get("name"), "admin": bool(d.get("admin")),
                "limits": d.get("limits") or {}, "createdAt": issued.get("recordedAt"),
                "revokedAt": revoked.get("recordedAt") if revoked else None}

    @api.post("/keys", status_code=201, tags=["keys"],
              responses={403: {"model": ApiError, "description": "the credential has no admin scope"}})
    async def create_key(body: CreateKey, who: Caller) -> dict[str, Any]:
        """Issue an API key for a tenant. The key is in this reply only: it is stored as an argon2id hash."""
        admin_only(who)
        key_id, secret, key = new_key()
        limits_ = {k: v for k, v in (("requestsPerSecond", body.requestsPerSecond),
                                     ("maxRunningTurns", body.maxRunningTurns)) if v is not None}
        data: dict[str, Any] = {"keyId": key_id, "tenantId": body.tenantId, "admin": body.admin,
                                "secretHash": await asyncio.to_thread(auth.hash_secret, secret), "limits": limits_}
        if body.name:
            data["name"] = body.name
        await backends.append(KEY_STREAM + key_id, [new_event("ApiKeyIssued", data)], expected=0)
        await backends.append(KEY_INDEX, [new_event("ApiKeyIndexed", {"keyId": key_id, "tenantId": body.tenantId})])
        log.info("api-key-issued", key_id=key_id, tenant=body.tenantId, admin=body.admin, by=who.subject)
        return {"keyId": key_id, "key": key, "tenantId": body.tenantId, "name": body.name, "admin": body.admin,
                "limits": limits_}

    @api.get("/keys", tags=["keys"],
             responses={403: {"model": ApiError, "description": "the credential has no admin scope"}})
    async def list_keys(who: Caller, tenant: Annotated[str | None, Query(max_length=128, pattern=TENANT_PATTERN)]
                        = None, revoked: bool = False) -> dict[str, Any]:
        """Issued keys (never their secrets), newest last; ``revoked`` includes revoked ones."""
        admin_only(who)
        index = await backends.read_stream_all(KEY_INDEX)
        ids = [e["data"]["keyId"] for e in index if tenant is None or e["data"]["tenantId"] == tenant]
        records = [r for r in [await key_record(i) for i in ids] if r is not None]
        return {"keys": [r for r in records if revoked or r["revokedAt"] is None]}

    @api.delete("/keys/{key_id}", tags=["keys"],
                responses={403: {"model": ApiError, "description": "the credential has no admin scope"}})
    async def revoke_key(key_id: Annotated[str, Path(pattern=r"^[0-9a-f]{16}$")], who: Caller) -> dict[str, Any]:
        """Revoke a key: refused at once by this replica, by every replica within CTX_AUTH_CACHE_S."""
        admin_only(who)
        record = await key_record(key_id)
        if record is None:
            raise ServiceError(f"key {key_id} not found", code="not-found")
        if record["revokedAt"] is None:
            await backends.append(KEY_STREAM + key_id, [new_event("ApiKeyRevoked", {"keyId": key_id})])
            log.info("api-key-revoked", key_id=key_id, by=who.subject)
        auth.forget(key_id)
        return {"keyId": key_id, "revoked": True}

    return api


def turn_in_progress(conversation_id: str, turn_id: str | None) -> ServiceError:
    which = f" ({turn_id})" if turn_id else ""
    return ServiceError(f"conversation {conversation_id} has a turn in progress{which}: one turn runs per "
                        "conversation at a time; wait for it to end (…/turns/{turnId}/events) or abort it",
                        code="turn-in-progress", details={"turnId": turn_id} if turn_id else None)


def _safe(text: Any) -> str:
    """Text for an error message: a NUL or a lone surrogate from the input must not break the reply itself."""
    return str(text).replace("\x00", "\\u0000").encode("utf-8", "backslashreplace").decode("utf-8")[:300]


def validation_message(exc: RequestValidationError) -> str:
    """Where and what, never the input itself (it may be megabytes)."""
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(_safe(x) for x in err.get("loc", ()))
        parts.append(f"{where}: {_safe(err.get('msg', 'invalid'))}" if where else _safe(err.get("msg", "invalid")))
    more = len(exc.errors()) - 5
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def install_error_handlers(app: FastAPI, auth: Authenticator | None = None) -> None:
    """Every refusal in the API's error shape ``{code, message, retryable}``: typed service errors, request
    validation (422 ``invalid-payload``) and the framework's own (unknown route, body over its limit → 413)."""
    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, exc: ServiceError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"code": "invalid-payload", "message": validation_message(exc), "retryable": False},
                            status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if (auth is not None and exc.status_code in (404, 405) and request.url.path.startswith("/v1/")
                and "principal" not in request.scope.get("state", {})):
            # no route matched: under /v1 an unauthenticated caller learns nothing about which routes exist
            try:
                await auth.authenticate(credential_of(request))
            except StarletteHTTPException as refused:
                exc = refused
        code = HTTP_CODES.get(exc.status_code, f"http-{exc.status_code}")
        return JSONResponse({"code": code, "message": _safe(exc.detail),
                             "retryable": exc.status_code >= 500 or exc.status_code == 429},
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))
