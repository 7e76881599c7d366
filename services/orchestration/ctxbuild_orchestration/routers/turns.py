"""/v1/conversations/{id}/turns: start, regenerate and abort turns; follow them (SSE), read them back."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Request, Response
from fastapi.routing import APIRoute
from sse_starlette import EventSourceResponse

from ..app.edge import Edge
from .common import TURN_CONFLICT, Caller, ConversationId, TurnId
from .models import Abort, CreateTurn, Regenerate


def router(edge: Edge, route_class: type[APIRoute], sse_poll_s: float) -> APIRouter:
    api = APIRouter(route_class=route_class)

    @api.post("/conversations/{conversation_id}/turns", status_code=202, responses=TURN_CONFLICT)
    async def create_turn(conversation_id: ConversationId, body: CreateTurn, who: Caller) -> dict[str, Any]:
        """409 ``turn-in-progress`` while the conversation's previous turn has not ended (one running turn per
        conversation); the user message hangs under the conversation's latest message."""
        return await edge.create_turn(who, conversation_id, body.text, body.provider, body.maxSteps)

    @api.post("/conversations/{conversation_id}/turns/{turn_id}/regenerate", status_code=202,
              responses=TURN_CONFLICT)
    async def regenerate(conversation_id: ConversationId, turn_id: TurnId,
                         who: Caller, body: Regenerate | None = None) -> dict[str, Any]:
        """A new turn over the same user message: its answer is a sibling branch of the regenerated one. 409
        ``turn-in-progress`` while a turn of the conversation is running (the regenerated one included)."""
        body = body or Regenerate()
        return await edge.regenerate(who, conversation_id, turn_id, body.provider, body.maxSteps)

    @api.post("/conversations/{conversation_id}/turns/{turn_id}/abort", status_code=202)
    async def abort(conversation_id: ConversationId, turn_id: TurnId, who: Caller,
                    body: Abort | None = None) -> dict[str, Any]:
        """Any turn that has not ended can be aborted, and always ends with exactly one terminal event (SPEC
        §15.4), freeing the conversation's turn lock. Durable first (TurnAbortRequested, read by the runner at
        pick-up and when its next write finds it), then a wake-up for the replica running it. A turn no runner
        has started (queued, its command maybe lost) is ended here at once; an admitted turn that was never
        queued too; a started one is ended here after a grace if no runner did it."""
        return await edge.abort(who, conversation_id, turn_id, (body.reason if body else None)
                                or "requested by the client")

    @api.get("/conversations/{conversation_id}/turns/{turn_id}/events")
    async def turn_events(conversation_id: ConversationId, turn_id: TurnId, request: Request, who: Caller,
                          last_event_id: str | None = Header(None), deltas: bool = True) -> Response:
        """The turn's events as SSE (``id`` = version, resumable with ``Last-Event-ID``), ending with the terminal
        one. With ``deltas`` (default) the model's text also streams in as ``TextDelta`` events (no ``id``: live
        only, never replayed — the step's assistant message is the record)."""
        start = int(last_event_id) + 1 if last_event_id and last_event_id.isdigit() else 1
        st, _ = await edge.turn_state(conversation_id, turn_id, who)
        if st.done and start > st.version:
            return Response(status_code=204)  # the turn ended and the client has seen every event: nothing to stream
        return EventSourceResponse(edge.event_stream(conversation_id, turn_id, st, start, deltas, sse_poll_s,
                                                     request.is_disconnected))

    @api.get("/conversations/{conversation_id}/turns/{turn_id}")
    async def turn_log(conversation_id: ConversationId, turn_id: TurnId, who: Caller) -> dict[str, Any]:
        """Status and events; message parts, tool inputs and outputs held by reference are shown inline, a fold
        checkpoint's compacted prefix stays a reference (each step's served request shows what the model saw)."""
        return await edge.turn_log(who, conversation_id, turn_id)

    @api.get("/conversations/{conversation_id}/turns/{turn_id}/steps/{step}/request")
    async def served_request(conversation_id: ConversationId, turn_id: TurnId, who: Caller,
                             step: Annotated[int, Path(ge=0, le=1_000_000)]) -> Response:
        """The request of one step exactly as the model saw it (the bytes whose sha256 is StepServed.requestHash)."""
        body, request_hash = await edge.served_request(who, conversation_id, turn_id, step)
        return Response(body, media_type="application/json",
                        headers={"X-Request-Hash": request_hash, "ETag": f'"{request_hash}"'})

    return api
