"""The gateway's client tools in a turn, pure (domain/client_tools.py): what is offered, which calls the client
runs, the messages a hand-over stores, and the result the client sees."""

from __future__ import annotations

from ctxbuild_orchestration.app.gateway import storable_parts, upstream_options
from ctxbuild_orchestration.domain.client_tools import (
    client_calls,
    client_names,
    gateway_result,
    handed_over_messages,
    result_summary,
    server_view,
    with_client_tools,
)
from ctxbuild_orchestration.domain.tools import FS_READ, READ_FILE
from ctxbuild_orchestration.domain.turn_state import StepRecord, TurnState, message_id
from ctxbuild_providers import ToolSpec

CMD = {"clientTools": [{"name": "get_weather", "description": "w", "inputSchema": {"type": "object"}},
                       {"name": "fs_read", "description": "the client's own", "inputSchema": {"type": "object"}}]}


def test_the_clients_tools_follow_ctxbuilds_and_win_a_name_clash():
    client = [ToolSpec(t["name"], t["description"], t["inputSchema"]) for t in CMD["clientTools"]]
    offered = with_client_tools([READ_FILE, FS_READ], client)
    assert [t.name for t in offered] == ["read_file", "get_weather", "fs_read"]
    assert offered[-1].description == "the client's own"
    assert client_names(CMD) == {"get_weather", "fs_read"} and client_names({}) == frozenset()


def turn_with(parts: list[dict], results: dict[str, dict], usage: dict | None = None) -> TurnState:
    st = TurnState("turn_x")
    st.steps[1] = StepRecord(1, {"id": "m1", "parentId": "u1", "role": "assistant", "turnId": "turn_x",
                                 "parts": [{"type": "text", "text": "Looking."},
                                           {"type": "tool-call", "toolCallId": "c1", "toolName": "fs_read",
                                            "input": {"uri": "u"}}],
                                 "usage": {"inputTokens": 10, "outputTokens": 2, "cacheReadTokens": 4}},
                             results={"c1": {"type": "tool-result", "toolCallId": "c1", "toolName": "fs_read",
                                             "output": {"type": "text", "value": "page"}}},
                             served_tokens=100, model_ms=5.5)
    st.steps[2] = StepRecord(2, {"id": "m2", "parentId": "t1", "role": "assistant", "turnId": "turn_x",
                                 "parts": parts, "usage": usage or {"inputTokens": 20, "outputTokens": 3}},
                             results=results, served_tokens=150, model_ms=4.5)
    return st


def test_a_hand_over_stores_the_call_and_the_server_side_results_only():
    clients = frozenset({"get_weather"})
    parts = [{"type": "text", "text": "Checking."},
             {"type": "tool-call", "toolCallId": "c2", "toolName": "get_weather", "input": {"city": "Oslo"}},
             {"type": "tool-call", "toolCallId": "c3", "toolName": "fs_read", "input": {"uri": "v"}}]
    server_result = {"type": "tool-result", "toolCallId": "c3", "toolName": "fs_read",
                     "output": {"type": "text", "value": "x"}}
    st = turn_with(parts, {"c3": server_result})
    assert [p["toolCallId"] for p in client_calls(st.steps[2].assistant, clients)] == ["c2"]
    assert [p.get("toolCallId") for p in server_view(st.steps[2].assistant, clients)["parts"]] == [None, "c3"]
    msgs = handed_over_messages(st, "u1", 2, clients)
    assert [m["role"] for m in msgs] == ["assistant", "tool", "assistant", "tool"]
    assert msgs[2]["parts"] == parts  # every call of the step stays on its message
    assert msgs[3] == {"id": message_id("turn_x", 2, "t"), "parentId": "m2", "role": "tool",
                       "parts": [server_result], "turnId": "turn_x"}
    result = gateway_result(st, {"c2"})
    assert result.text == "Looking.\n\nChecking." and result.stop_reason == "tool_calls"
    assert result.tool_calls == [{"toolCallId": "c2", "toolName": "get_weather", "input": {"city": "Oslo"}}]
    assert result.usage == {"inputTokens": 30, "outputTokens": 5, "cacheReadTokens": 4}
    summary = result_summary(st, result)
    assert (summary["servedTokens"], summary["modelMs"]) == (250, 10.0)


def test_without_server_side_calls_the_hand_over_adds_no_tool_message():
    parts = [{"type": "tool-call", "toolCallId": "c2", "toolName": "get_weather", "input": {}}]
    st = turn_with(parts, {})
    msgs = handed_over_messages(st, "u1", 2, frozenset({"get_weather"}))
    assert [m["role"] for m in msgs] == ["assistant", "tool", "assistant"]
    assert gateway_result(st, set()).tool_calls == []  # nothing pending: no call handed over


def test_client_options_in_the_upstreams_terms():
    opts = {"temperature": 0.1, "stop": "END", "logprobs": True, "n": 1, "top_k": 3}
    assert upstream_options(opts, "anthropic") == {"temperature": 0.1, "stop_sequences": ["END"], "top_k": 3}
    assert upstream_options(opts, "openai") == {"temperature": 0.1, "stop": "END"}
    assert upstream_options({"stop_sequences": ["a"]}, "openai") == {"stop": ["a"]}


def test_arguments_that_are_not_an_object_are_kept_whole():
    parts = [{"type": "tool-call", "toolCallId": "c", "toolName": "t", "input": "{not json"},
             {"type": "tool-call", "toolCallId": "d", "toolName": "t", "input": {"a": 1}}]
    assert [p["input"] for p in storable_parts(parts)] == [{"arguments": "{not json"}, {"a": 1}]
