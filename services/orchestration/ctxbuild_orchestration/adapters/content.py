"""Turn events stay small (SPEC §15.1): large content is stored as a blob and the event names it by reference
(``ctxbuild_blobclient.content_ref``, ``contracts/model/content-ref.json``).

Write side (the runner): an assistant message's parts, a tool call's input, a tool result's output and a
turn's answer are inline
when small, by reference when large — kept blobs of the turn (``tool_output``, like the served requests: the turn
log shows them). A step's served request follows the same rule: its text in StepServed when small, else a blob.
A checkpoint's compacted prefix is a provisional blob of the turn: it is needed to resume the turn and released
when the turn ends.

Read side: the runner resolves what it folds (a resumed turn replays exactly the same messages); the edge
resolves what it presents (turn log, SSE) and leaves a checkpoint's prefix as its reference (the served request of
each step is what the model saw).
"""

from __future__ import annotations

import asyncio
from typing import Any

from ctxbuild_blobclient import content_ref

from ..domain.turn_state import TurnState

KEPT = "tool_output"  # lives as long as the turn's other blobs (its served requests)
PROVISIONAL = "provisional"  # released when the turn ends
PRESENT_CONCURRENCY = 8


def turn_owner(turn_id: str) -> tuple[str, str]:
    return ("turn", turn_id)


# ------------------------------------------------------------------ write side
async def small_message(blobs: content_ref.BlobPort, message: dict[str, Any], conversation_id: str,
                        turn_id: str) -> dict[str, Any]:
    return await content_ref.store_message_parts(blobs, message, conversation_id, turn_owner(turn_id), KEPT)


async def small_value(blobs: content_ref.BlobPort, value: Any, conversation_id: str, turn_id: str) -> Any:
    return await content_ref.store_if_large(blobs, value, conversation_id, turn_owner(turn_id), KEPT)


async def small_checkpoint(blobs: content_ref.BlobPort, checkpoint: dict[str, Any], conversation_id: str,
                           turn_id: str) -> dict[str, Any]:
    """Compaction already names a large prefix by reference; this covers a reply whose blob write failed there."""
    prefix = checkpoint.get("compactedPrefix")
    if content_ref.is_ref(prefix):
        return checkpoint
    ref = await content_ref.store_if_large(blobs, prefix, conversation_id, turn_owner(turn_id), PROVISIONAL)
    return {**checkpoint, "compactedPrefix": ref}


def inline_request(body: bytes) -> str | None:
    """A served request's text when it is small enough to be kept in its StepServed event (``request.body``)
    instead of a blob: the rule of every value of a turn event (inline up to ``content_ref.INLINE_MAX_BYTES`` of
    JSON), and no blob write beside the model call. None: keep it as a blob."""
    if len(body) > content_ref.INLINE_MAX_BYTES:
        return None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return None
    # measured as every inline value is (escaping may grow it past the limit)
    return text if len(content_ref.encode(text)) <= content_ref.INLINE_MAX_BYTES else None


# ------------------------------------------------------------------ read side
async def resolve_steps(blobs: content_ref.BlobPort, st: TurnState) -> TurnState:
    """The folded state with every step's assistant parts and tool outputs inline (in place)."""
    conversation_id = (st.command or {}).get("conversationId", "")
    for rec in st.steps.values():
        rec.assistant = await content_ref.resolve_message(blobs, rec.assistant, conversation_id)
        for call_id, part in rec.results.items():
            if content_ref.is_ref(part.get("output")):
                rec.results[call_id] = {**part, "output": await content_ref.resolve(blobs, part["output"],
                                                                                    conversation_id)}
    return st


async def present_event(blobs: content_ref.BlobPort, event: dict[str, Any], conversation_id: str) -> dict[str, Any]:
    """An event as a client reads it: message parts, tool inputs and outputs inline."""
    t, d = event["type"], event["data"]
    if t == "StepServed" and content_ref.is_ref((d.get("assistantMessage") or {}).get("parts")):
        d = {**d, "assistantMessage": await content_ref.resolve_message(blobs, d["assistantMessage"],
                                                                        conversation_id)}
    elif t == "ToolCallRequested" and content_ref.is_ref(d.get("input")):
        d = {**d, "input": await content_ref.resolve(blobs, d["input"], conversation_id)}
    elif t == "ToolResultRecorded" and content_ref.is_ref(d.get("output")):
        d = {**d, "output": await content_ref.resolve(blobs, d["output"], conversation_id)}
    elif t == "TurnCompleted" and content_ref.is_ref(d.get("answer")):
        d = {**d, "answer": await content_ref.resolve(blobs, d["answer"], conversation_id)}
    else:
        return event
    return {**event, "data": d}


async def present_events(blobs: content_ref.BlobPort, events: list[dict[str, Any]],
                         conversation_id: str) -> list[dict[str, Any]]:
    gate = asyncio.Semaphore(PRESENT_CONCURRENCY)

    async def one(ev: dict[str, Any]) -> dict[str, Any]:
        async with gate:
            return await present_event(blobs, ev, conversation_id)

    return list(await asyncio.gather(*(one(ev) for ev in events)))
