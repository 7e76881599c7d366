"""Turn events stay small (SPEC §15.1): the runner writes large assistant parts, tool inputs, tool outputs and a
fold checkpoint's prefix by reference; a resumed runner folds and resolves them back to exactly the messages the
first run had; the edge presents them inline (turn log, SSE) but leaves a checkpoint's prefix as a reference."""

from __future__ import annotations

import copy
import json

from ctxbuild_blobclient import content_ref
from ctxbuild_orchestration.adapters import content
from ctxbuild_orchestration.domain.turn_state import fold, message_id
from ctxbuild_platform import contracts

from tests.support.compaction import MemoryBlobs

T, C = "turn_abc", "conv_abc"
BIG = "".join(f"line {i}: the model explains its plan at length\n" for i in range(900))  # ≈ 40 KB


def ev(v: int, type_: str, data: dict) -> dict:
    contracts.validate(f"events/{type_}.json", data)
    return {"version": v, "type": type_, "data": data}


async def turn_events(blobs, text: str, output: str, args: dict) -> tuple[list[dict], list[dict]]:
    """A one-step turn with one tool call, written as the runner writes it: (events, the turn's messages)."""
    call = {"type": "tool-call", "toolCallId": "call_1", "toolName": "bash", "input": args}
    a_msg = {"id": message_id(T, 1, "a"), "parentId": "u", "role": "assistant",
             "parts": [{"type": "text", "text": text}, call], "turnId": T}
    out = {"type": "text", "value": output}
    events = [
        ev(1, "TurnQueued", {"turnId": T, "conversationId": C, "userMessageId": "u",
                             "provider": {"kind": "replay", "script": [{}]}}),
        ev(2, "StepServed", {"turnId": T, "step": 1, "servedTokens": 1, "messagesServed": 1, "requestHash": "h",
                             "assistantMessage": await content.small_message(blobs, a_msg, C, T)}),
        ev(3, "ToolCallRequested", {"turnId": T, "step": 1, "toolCallId": "call_1", "toolName": "bash",
                                    "input": await content.small_value(blobs, args, C, T)}),
        ev(4, "ToolResultRecorded", {"turnId": T, "step": 1, "toolCallId": "call_1", "toolName": "bash",
                                     "output": await content.small_value(blobs, out, C, T), "trimmed": False}),
    ]
    messages = [a_msg, {"id": message_id(T, 1, "t"), "parentId": a_msg["id"], "role": "tool",
                        "parts": [{"type": "tool-result", "toolCallId": "call_1", "toolName": "bash",
                                   "output": out}], "turnId": T}]
    return events, messages


def largest_event(events: list[dict]) -> int:
    return max(len(json.dumps(e["data"], ensure_ascii=False).encode()) for e in events)


async def test_large_content_is_stored_by_reference_and_a_resume_replays_the_same_bytes():
    blobs = MemoryBlobs()
    events, messages = await turn_events(blobs, BIG, BIG * 2, {"command": BIG})
    assert largest_event(events) < 2_000
    assert content_ref.is_ref(events[1]["data"]["assistantMessage"]["parts"])
    assert content_ref.is_ref(events[2]["data"]["input"]) and content_ref.is_ref(events[3]["data"]["output"])
    # kept blobs of the turn (the turn log shows them after the turn), not provisional ones
    assert {(owner, role) for _, owner, role in blobs.refs} == {(("turn", T), "tool_output")}
    st = await content.resolve_steps(blobs, fold(T, copy.deepcopy(events)))
    assert json.dumps(st.messages("u")) == json.dumps(messages)
    assert st.steps[1].complete and st.steps[1].calls[0]["input"] == {"command": BIG}


async def test_small_content_stays_inline_without_a_blob_write():
    blobs = MemoryBlobs()
    events, messages = await turn_events(blobs, "short answer", "ok", {"command": "ls"})
    assert blobs.refs == []
    assert events[1]["data"]["assistantMessage"] == messages[0]
    st = await content.resolve_steps(blobs, fold(T, events))
    assert st.messages("u") == messages


async def test_the_edge_presents_content_inline_and_leaves_the_checkpoint_prefix_referenced():
    blobs = MemoryBlobs()
    events, messages = await turn_events(blobs, BIG, BIG, {"command": BIG})
    prefix = [{"id": f"m{i}", "role": "user", "parts": [{"type": "text", "text": BIG}]} for i in range(2)]
    ck = await content.small_checkpoint(blobs, {"consumedCount": 2, "compactedPrefix": prefix}, C, T)
    assert blobs.refs[-1][1:] == (("turn", T), "provisional")  # needed to resume, released when the turn ends
    assert await content.small_checkpoint(blobs, ck, C, T) == ck  # already a reference: nothing written again
    events.append(ev(5, "InLoopFoldRecorded", {"turnId": T, "step": 2, **ck}))
    shown = await content.present_events(blobs, events, C)
    assert shown[1]["data"]["assistantMessage"] == messages[0]
    assert shown[2]["data"]["input"] == {"command": BIG}
    assert shown[3]["data"]["output"] == messages[1]["parts"][0]["output"]
    assert shown[4] == events[4] and content_ref.is_ref(shown[4]["data"]["compactedPrefix"])
    assert await content_ref.resolve(blobs, ck["compactedPrefix"], C) == prefix


async def test_a_long_answer_travels_by_reference_and_is_presented_inline():
    blobs = MemoryBlobs()
    answer = "é" * 40_000  # 80 KB of JSON: more than an event may hold
    data = {"turnId": T, "steps": 1, "answer": await content.small_value(blobs, answer, C, T), "messageIds": ["m"]}
    contracts.validate("events/TurnCompleted.json", data)
    assert content_ref.is_ref(data["answer"]) and len(json.dumps(data)) < 1_000
    shown = await content.present_event(blobs, {"type": "TurnCompleted", "data": data}, C)
    assert shown["data"]["answer"] == answer
    short = {"turnId": T, "steps": 1, "answer": await content.small_value(blobs, "done", C, T)}
    assert short["answer"] == "done"
