"""The turn's state folded from its events (pure): what a resuming runner continues from."""

from __future__ import annotations

from ctxbuild_orchestration.domain.turn_state import event_id, fold, message_id

T = "turn_abc"


def ev(v: int, type_: str, **data) -> dict:
    return {"version": v, "type": type_, "data": {"turnId": T, **data}}


def call(step: int, i: int) -> dict:
    return {"type": "tool-call", "toolCallId": f"call_{step}_{i}", "toolName": "web_fetch", "input": {"url": "u"}}


def served(v: int, step: int, parts: list[dict], parent: str) -> dict:
    msg = {"id": message_id(T, step, "a"), "parentId": parent, "role": "assistant", "parts": parts, "turnId": T}
    return ev(v, "StepServed", step=step, servedTokens=1, messagesServed=1, requestHash="h", assistantMessage=msg)


def result(v: int, step: int, i: int) -> dict:
    return ev(v, "ToolResultRecorded", step=step, toolCallId=f"call_{step}_{i}", toolName="web_fetch",
              output={"type": "text", "value": f"r{step}.{i}"}, trimmed=False)


def test_ids_are_stable_and_distinct():
    assert message_id(T, 1, "a") == message_id(T, 1, "a") != message_id(T, 1, "t") != message_id(T, 2, "a")
    assert event_id(T, "StepServed", 3) == event_id(T, "StepServed", 3) != event_id(T, "StepServed", 4)
    assert event_id(T, "terminal") != event_id("turn_other", "terminal")


def test_a_turn_killed_mid_step_resumes_with_recorded_results_only():
    events = [
        ev(1, "TurnQueued", conversationId="c", userMessageId="u", provider={"kind": "replay", "script": [{}]}),
        ev(2, "TurnStarted", conversationId="c", userMessageId="u"),
        ev(3, "CompactionDecided", phase="turn-start", status="skipped"),
        served(4, 1, [call(1, 1)], "u"),
        ev(5, "ToolCallRequested", step=1, toolCallId="call_1_1", toolName="web_fetch", input={}),
        result(6, 1, 1),
        served(7, 2, [call(2, 1), call(2, 2)], message_id(T, 1, "t")),
        ev(8, "ToolCallRequested", step=2, toolCallId="call_2_1", toolName="web_fetch", input={}),
        result(9, 2, 1),
        ev(10, "ToolCallRequested", step=2, toolCallId="call_2_2", toolName="web_fetch", input={}),
        # killed here: call_2_2 requested, never recorded
    ]
    st = fold(T, events)
    assert st.started and st.attempts == 1 and st.turn_start_recorded and not st.done and st.version == 10
    assert st.next_step == 3
    assert st.steps[1].complete and not st.steps[2].complete
    assert [c["toolCallId"] for c in st.steps[2].calls if c["toolCallId"] not in st.steps[2].results] == ["call_2_2"]
    assert st.steps[2].requested == {"call_2_1", "call_2_2"}
    msgs = st.messages("u")
    # step 2's tool message is not served until its last result exists
    assert [m["role"] for m in msgs] == ["assistant", "tool", "assistant"]
    assert msgs[1]["id"] == message_id(T, 1, "t") and msgs[1]["parts"][0]["output"]["value"] == "r1.1"
    assert msgs[2]["parentId"] == msgs[1]["id"]


def test_results_come_back_in_call_order_and_terminal_abort_checkpoint_fold():
    events = [served(1, 1, [call(1, 1), call(1, 2)], "u"), result(2, 1, 2), result(3, 1, 1),
              ev(4, "InLoopFoldRecorded", step=2, consumedCount=2, compactedPrefix=[{"role": "user"}]),
              ev(5, "TurnAbortRequested", reason="stop"), ev(6, "TurnFailed", code="aborted", message="m")]
    st = fold(T, events)
    assert [p["toolCallId"] for p in st.messages("u")[1]["parts"]] == ["call_1_1", "call_1_2"]
    assert st.checkpoint == {"consumedCount": 2, "compactedPrefix": [{"role": "user"}]}
    assert st.abort == {"turnId": T, "reason": "stop"}
    assert st.done and st.terminal["data"]["code"] == "aborted"


def test_a_resumed_attempt_counts():
    st = fold(T, [ev(1, "TurnStarted"), ev(2, "TurnResumed", attempt=2, fromStep=1)])
    assert st.attempts == 2 and st.command is None and st.next_step == 1
