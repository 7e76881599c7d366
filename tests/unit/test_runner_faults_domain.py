"""Fault handling's pure parts (SPEC §15.4): the in-process window fit used when compaction is away, the messages
a failed turn keeps, and the request refusals every @rpc handler gets before it runs."""

from __future__ import annotations

import asyncio
import json

from ctxbuild_codec import render_marker
from ctxbuild_codec.tokens import count_messages
from ctxbuild_orchestration.domain.turn_state import fold, message_id
from ctxbuild_orchestration.domain.window_fit import fit_window
from ctxbuild_platform.rpc import dispatch, unprocessable

T = "turn_faults"
URI = "context://vfs/vfs_0123456789abcdef.txt"


def user(i: str, text: str) -> dict:
    return {"id": i, "role": "user", "parts": [{"type": "text", "text": text}]}


def group(n: int, output: dict, offload: dict | None = None) -> list[dict]:
    call = {"type": "tool-call", "toolCallId": f"c{n}", "toolName": "web_fetch", "input": {"url": f"u{n}"}}
    res = {"type": "tool-result", "toolCallId": f"c{n}", "toolName": "web_fetch", "output": output}
    if offload:
        res["offload"] = offload
    return [{"id": f"a{n}", "role": "assistant", "parts": [call]}, {"id": f"t{n}", "role": "tool", "parts": [res]}]


def big(n: int) -> str:
    return "\n".join(f"line {i} of output {n}: " + "lorem ipsum dolor sit amet " * 6 for i in range(400))


def test_under_the_room_nothing_changes():
    msgs = [user("u", "task"), *group(1, {"type": "text", "value": "short"})]
    fit = fit_window(msgs, 10_000, "u")
    assert fit.messages == msgs and fit.stages == "in-process:none"


def test_archived_outputs_become_markers_first():
    off = {"mode": "offloaded", "uri": URI, "sha256": "0" * 64, "totalChars": 120_000, "totalLines": 400}
    msgs = [user("u", "task"), *group(1, {"type": "text", "value": big(1)}, off),
            *group(2, {"type": "text", "value": "small"})]
    room = count_messages(msgs) // 4
    fit = fit_window(msgs, room, "u")
    assert fit.tokens <= room and fit.masked == 1 and fit.dropped == 0
    assert fit.messages[2]["parts"][0]["output"]["value"] == render_marker("", "", 400, 120_000, URI)
    assert fit.messages[2]["parts"][0]["offload"]["uri"] == URI  # still readable with fs_read


def test_unarchived_outputs_are_excerpted_then_oldest_groups_dropped():
    msgs = [user("h", "old question"), {"id": "h2", "role": "assistant", "parts": [{"type": "text", "text": big(0)}]},
            user("u", "task")]
    for n in range(1, 6):
        msgs += group(n, {"type": "text", "value": big(n)})
    room = 900
    fit = fit_window(msgs, room, "u")
    assert fit.tokens <= room
    assert fit.excerpted >= 1 and fit.dropped >= 2
    ids = [m["id"] for m in fit.messages]
    assert ids[0] == "u" and ids[-2:] == ["a5", "t5"]  # the task and the newest group stay
    # never a tool call without its result, never a result without its call
    for i, m in enumerate(fit.messages):
        if m["role"] == "tool":
            assert fit.messages[i - 1]["role"] == "assistant"
        if m["role"] == "assistant" and any(p["type"] == "tool-call" for p in m["parts"]):
            assert fit.messages[i + 1]["role"] == "tool"
    assert fit_window(msgs, room, "u").messages == fit.messages  # deterministic: same bytes every time


def _served(v: int, step: int, parts: list[dict], parent: str) -> dict:
    msg = {"id": message_id(T, step, "a"), "parentId": parent, "role": "assistant", "parts": parts, "turnId": T}
    return {"version": v, "type": "StepServed", "data": {"turnId": T, "step": step, "servedTokens": 1,
                                                         "messagesServed": 1, "requestHash": "h",
                                                         "assistantMessage": msg}}


def test_a_failed_turn_keeps_only_finished_steps():
    def c(s):
        return {"type": "tool-call", "toolCallId": f"call_{s}", "toolName": "web_fetch", "input": {}}

    def res(v, s):
        return {"version": v, "type": "ToolResultRecorded", "data": {
            "turnId": T, "step": s, "toolCallId": f"call_{s}", "toolName": "web_fetch",
            "output": {"type": "text", "value": "r"}, "trimmed": False}}
    events = [{"version": 1, "type": "TurnQueued", "data": {"turnId": T, "conversationId": "c", "userMessageId": "u"}},
              _served(2, 1, [c(1)], "u"), res(3, 1), _served(4, 2, [c(2)], message_id(T, 1, "t"))]
    st = fold(T, events)
    kept = st.finished_messages("u")
    assert [m["id"] for m in kept] == [message_id(T, 1, "a"), message_id(T, 1, "t")]  # step 2 has no result


def test_malformed_requests_are_refused_by_reason():
    assert "nests deeper" in unprocessable(json.loads("[" * 300 + "]" * 300))
    assert "lone surrogate" in unprocessable({"s": "ok\ud800"})
    assert "lone surrogate" in unprocessable({"k\udfff": 1})
    assert unprocessable({"a": [1, 2**70, 1.5, None, True, "😀"]}) is None  # a tool output may hold any number


def test_dispatch_answers_invalid_payload_not_internal():
    async def never(_payload):
        raise AssertionError("the handler must not run")

    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"streamId":"\\ud800"}'):
        reply = asyncio.run(dispatch("ctx.persist.read_stream", raw, never))
        assert reply["error"]["code"] == "invalid-payload", reply


def test_a_consumer_loop_that_raises_is_restarted_and_reported():
    """supervise: a RecursionError (what a deeply nested message once raised out of the pull loop) is logged,
    shown in the health report, and the loop runs again; the consumer is ready only while consuming."""
    from ctxbuild_platform.consumers import ConsumerHealth, supervise

    async def scenario() -> tuple[list[str], ConsumerHealth]:
        health, stopping, seen = ConsumerHealth("c"), asyncio.Event(), []
        runs = 0

        async def loop() -> None:
            nonlocal runs
            runs += 1
            if runs == 1:
                raise RecursionError("maximum recursion depth exceeded while decoding a JSON array")
            health.consuming()
            seen.append(health.state if health.ok else "not-ok")
            stopping.set()

        health.task = asyncio.current_task()
        await supervise("c", loop, health, stopping, max_backoff_s=0.01)
        return seen, health

    seen, health = asyncio.run(scenario())
    assert seen == ["consuming"] and health.restarts == 1 and health.state == "stopped"
    assert not health.ok and health.report()["state"] == "stopped"
