"""HTTP/SSE edge (FastAPI). Thin: validate, hand to the backends or the runner, map typed errors to HTTP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from ctxbuild_blobclient import content_ref
from ctxbuild_platform import contracts
from ctxbuild_platform.errors import InvalidPayload, RemoteError, ServiceError
from fastapi import APIRouter, FastAPI, File, Header, Request, Response, UploadFile
from fastapi.responses import JSONResponse
from opentelemetry.propagate import inject
from pydantic import BaseModel, Field
from sse_starlette import EventSourceResponse

from .adapters import content
from .adapters.backends import Backends, new_event
from .adapters.work_queue import ABORT_SUBJECT, TurnQueue
from .domain.results import full_output
from .domain.turn_state import fold
from .runner import DELTA_SUBJECT, new_id

TERMINAL = {"TurnCompleted", "TurnFailed"}
STATUS = {"invalid-payload": 422, "not-found": 404, "version-conflict": 409, "unavailable": 503, "timeout": 504,
          "provider-not-configured": 400, "unsupported-media": 415, "conflict": 409,
          "too-large": 413}
REPLAY_INLINE_MAX_BYTES = 32 * 1024  # a larger replay script goes to the blob store with the turn (events stay small)


class ConversationSettings(BaseModel):
    contextWindow: int | None = Field(None, gt=0, description="model context window in tokens; null = unknown")
    reservation: int | None = Field(None, ge=0)
    truncateThreshold: int | None = Field(None, ge=2000)
    maxMessages: int | None = Field(None, ge=1)
    compressEnabled: bool = True
    mcpMode: Literal["manual", "auto", "disabled"] = "manual"
    mcpServers: list[str] = Field(default_factory=list)
    webTools: bool = Field(True, description="offer the deployment's web tools (web_fetch, web_search) to the model")
    summarizer: Literal["extractive", "llm", "masking"] | None = Field(
        None, description="which summarizer folds (SPEC §10); null = the compaction service's default")


class CreateConversation(BaseModel):
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
    model: str = Field(min_length=1)


class AnthropicSpec(BaseModel):
    """A Claude model through the Messages API (CTX_ANTHROPIC_API_KEY, optional CTX_ANTHROPIC_BASE_URL)."""

    kind: Literal["anthropic"]
    model: str = Field(min_length=1)


ProviderSpec = Annotated[ReplaySpec | OpenAISpec | AnthropicSpec, Field(discriminator="kind")]


class CreateTurn(BaseModel):
    text: str = Field(min_length=1)
    provider: ProviderSpec
    maxSteps: int | None = Field(None, ge=1, description="model calls this turn may make (default: the server's)")


class Regenerate(BaseModel):
    provider: ProviderSpec | None = Field(None, description="default: the regenerated turn's provider")
    maxSteps: int | None = Field(None, ge=1)


class Abort(BaseModel):
    reason: str | None = Field(None, max_length=500)


def error_response(exc: ServiceError) -> JSONResponse:
    if isinstance(exc, RemoteError):
        # a backend refusing our own request is our fault (502), not the client's (422)
        status = {"not-found": 404, "version-conflict": 409}.get(exc.code, 503 if exc.retryable else 502)
    else:
        status = STATUS.get(exc.code, 500)
    return JSONResponse(exc.to_payload(), status_code=status)


def build_api(backends: Backends, queue: TurnQueue, sse_poll_s: float,
              check_provider: Callable[[dict[str, Any]], None], max_steps_limit: int) -> APIRouter:
    api = APIRouter(prefix="/v1")

    async def conversation_settings(conversation_id: str) -> dict[str, Any]:
        first = await backends.read_stream(f"conversation:{conversation_id}", 1, limit=1)
        if not first["events"] or first["events"][0]["type"] != "ConversationCreated":
            raise ServiceError(f"conversation {conversation_id} not found", code="not-found")
        return first["events"][0]["data"].get("settings", {})

    async def turn_state(conversation_id: str, turn_id: str):
        events = await backends.read_stream_all(f"turn:{turn_id}")
        st = fold(turn_id, events)
        if st.command is None or st.command.get("conversationId") != conversation_id:
            raise ServiceError(f"turn {turn_id} not found in conversation {conversation_id}", code="not-found")
        return st, events

    async def provider_payload(conversation_id: str, turn_id: str, spec: BaseModel) -> dict[str, Any]:
        """The provider as the turn command records it: never a secret; a large replay script by reference."""
        data = spec.model_dump(exclude_none=True)
        check_provider(data)
        if data["kind"] == "replay":
            raw = json.dumps({"script": data["script"], "tools": data.get("tools", [])}, ensure_ascii=False)
            if len(raw.encode()) > REPLAY_INLINE_MAX_BYTES:
                stored = await backends.blobs.put(raw, conversation_id, ("turn", turn_id), "tool_output",
                                                  media_type="application/json")
                return {"kind": "replay", "scriptRef": {"sha256": stored["sha256"], "size": stored["size"]}}
        return data

    async def enqueue(conversation_id: str, turn_id: str, user_message_id: str, provider: dict[str, Any],
                      settings: dict[str, Any], max_steps: int | None, regenerate_of: str | None = None) -> None:
        if max_steps is not None and max_steps > max_steps_limit:
            raise ServiceError(f"maxSteps {max_steps} is above this server's limit {max_steps_limit}",
                               code="invalid-payload")
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
            await backends.append(f"turn:{turn_id}", [new_event("TurnFailed", {
                "turnId": turn_id, "code": "unavailable", "message": "the work queue refused the turn",
                "retryable": True})])
            raise ServiceError(f"the work queue is unavailable: {exc}", code="unavailable", retryable=True) from exc

    def accepted(conversation_id: str, turn_id: str, user_message_id: str) -> dict[str, Any]:
        return {"turnId": turn_id, "userMessageId": user_message_id,
                "events": f"/v1/conversations/{conversation_id}/turns/{turn_id}/events"}

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
        turn_id, msg_id = new_id("turn"), new_id("msg")
        provider = await provider_payload(conversation_id, turn_id, body.provider)
        hist = await backends.history(conversation_id)
        parent = hist["messages"][-1]["id"] if hist["messages"] else None
        message = {"id": msg_id, "parentId": parent, "role": "user", "parts": [{"type": "text", "text": body.text}]}
        # large parts by reference (the event stays small), owned by the conversation: never collected
        message = await content_ref.store_message_parts(backends.blobs, message, conversation_id,
                                                        ("conversation", conversation_id), "tool_output")
        await backends.append(f"conversation:{conversation_id}", [new_event("UserMessageAdded", {"message": message})])
        await enqueue(conversation_id, turn_id, msg_id, provider, cs, body.maxSteps)
        return accepted(conversation_id, turn_id, msg_id)

    @api.post("/conversations/{conversation_id}/turns/{turn_id}/regenerate", status_code=202)
    async def regenerate(conversation_id: str, turn_id: str, body: Regenerate | None = None) -> dict[str, Any]:
        """A new turn over the same user message: its answer is a sibling branch of the regenerated one."""
        body = body or Regenerate()
        st, _ = await turn_state(conversation_id, turn_id)
        cs = await conversation_settings(conversation_id)
        new_turn = new_id("turn")
        cmd = st.command or {}
        provider = (await provider_payload(conversation_id, new_turn, body.provider) if body.provider
                    else cmd["provider"])
        max_steps = body.maxSteps if body.maxSteps is not None else cmd.get("maxSteps")
        await enqueue(conversation_id, new_turn, cmd["userMessageId"], provider, cs, max_steps,
                      regenerate_of=turn_id)
        return {**accepted(conversation_id, new_turn, cmd["userMessageId"]), "regenerateOf": turn_id}

    @api.post("/conversations/{conversation_id}/turns/{turn_id}/abort", status_code=202)
    async def abort(conversation_id: str, turn_id: str, body: Abort | None = None) -> dict[str, Any]:
        """Durable first (TurnAbortRequested, read by the runner at pick-up and when its next write finds it), then a
        wake-up for the replica running it."""
        st, _ = await turn_state(conversation_id, turn_id)
        if st.done:
            raise ServiceError(f"turn {turn_id} already ended ({st.terminal['type']})", code="conflict")
        reason = (body.reason if body else None) or "requested by the client"
        await backends.append(f"turn:{turn_id}", [new_event("TurnAbortRequested", {"turnId": turn_id,
                                                                                  "reason": reason})])
        await backends.rpc.broker.publish({"turnId": turn_id, "reason": reason}, ABORT_SUBJECT)
        return {"turnId": turn_id, "status": "abort-requested"}

    @api.get("/conversations/{conversation_id}/turns/{turn_id}/events")
    async def turn_events(conversation_id: str, turn_id: str, request: Request,
                          last_event_id: str | None = Header(None), deltas: bool = True) -> Response:
        """The turn's events as SSE (``id`` = version, resumable with ``Last-Event-ID``), ending with the terminal
        one. With ``deltas`` (default) the model's text also streams in as ``TextDelta`` events (no ``id``: live
        only, never replayed — the step's assistant message is the record)."""
        start = int(last_event_id) + 1 if last_event_id and last_event_id.isdigit() else 1
        st, _ = await turn_state(conversation_id, turn_id)
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
    async def turn_log(conversation_id: str, turn_id: str) -> dict[str, Any]:
        """Status and events; message parts, tool inputs and outputs held by reference are shown inline, a fold
        checkpoint's compacted prefix stays a reference (each step's served request shows what the model saw)."""
        st, events = await turn_state(conversation_id, turn_id)
        events = await content.present_events(backends.blobs, events, conversation_id)
        status = ("completed" if st.terminal and st.terminal["type"] == "TurnCompleted" else
                  "failed" if st.terminal else "running" if st.started else "queued")
        out: dict[str, Any] = {"turnId": turn_id, "status": status, "steps": len(st.steps), "events": events}
        if st.terminal and st.terminal["type"] == "TurnFailed":
            out["error"] = {k: st.terminal["data"].get(k) for k in ("code", "message", "retryable")}
        return out

    @api.get("/conversations/{conversation_id}/turns/{turn_id}/steps/{step}/request")
    async def served_request(conversation_id: str, turn_id: str, step: int) -> Response:
        """The request of one step exactly as the model saw it (the bytes whose sha256 is StepServed.requestHash)."""
        _, events = await turn_state(conversation_id, turn_id)
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
    async def messages(conversation_id: str, branches: bool = False, anchor: str | None = None) -> dict[str, Any]:
        """The path from the root to ``anchor`` (default: the latest message); ``branches`` adds, for every path
        message with siblings (regenerated answers), the sibling ids — pass one as ``anchor`` to read that branch."""
        await conversation_settings(conversation_id)
        return await backends.history_all(conversation_id, anchor, branches)

    @api.get("/conversations/{conversation_id}/messages/{message_id}/results/{tool_call_id}")
    async def tool_result(conversation_id: str, message_id: str, tool_call_id: str) -> dict[str, Any]:
        """A tool result read back in full for a UI: persisted envelopes are inflated by the blob store, in-flight
        offloads are read from their blobs; a result that was never trimmed is returned as stored."""
        # the path to the message (any branch) ends with the message itself
        hist = await backends.rpc.call("ctx.persist.history", {"conversationId": conversation_id,
                                                               "anchorId": message_id})
        msg = hist["messages"][-1] if hist["messages"] else None
        part = next((p for p in (msg or {}).get("parts", []) if p.get("type") == "tool-result"
                     and p.get("toolCallId") == tool_call_id), None)
        if part is None:
            raise ServiceError(f"no tool result {tool_call_id} in message {message_id}", code="not-found")
        return await full_output(backends, conversation_id, part)

    return api


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, exc: ServiceError) -> JSONResponse:
        return error_response(exc)
