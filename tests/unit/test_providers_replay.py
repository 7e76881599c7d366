"""The replay provider: explicit step numbers, recorded tool outputs and tools, script validation."""

from __future__ import annotations

import pytest
from ctxbuild_providers import ModelRequest, ProviderError, ReplayProvider, ToolSpec

URI = "context://vfs/vfs_aaaaaaaaaaaaaaaa.txt"
SCRIPT = [
    {"text": "Reading.", "toolCalls": [
        {"toolName": "bash", "input": {"command": "ls"}, "output": {"type": "text", "value": "a.txt\nb.txt\n"}},
        {"toolName": "bash", "input": {"command": "false"}, "output": {"type": "error-text", "value": "exit 1"}}]},
    {"toolCalls": [{"toolName": "fs_read", "input": {"uri": "{{last_offload_uri}}"}}]},
    {"text": "Done."},
]


def user_only():
    return [{"id": "u", "role": "user", "parts": [{"type": "text", "text": "go"}]}]


def with_offload():
    return [*user_only(), {"id": "t", "role": "tool", "parts": [{
        "type": "tool-result", "toolCallId": "c", "toolName": "x", "output": {"type": "text", "value": "m"},
        "offload": {"uri": URI, "mode": "offloaded"}}]}]


async def test_an_explicit_step_wins_over_inference_from_messages():
    p = ReplayProvider(SCRIPT)
    # the messages say "first call of the turn"; the runner says step 3 (rows were folded away)
    r = await p.complete(ModelRequest("replay", "s", user_only()), step=3)
    assert r.parts == [{"type": "text", "text": "Done."}] and r.stop_reason == "stop"
    second = await p.complete(ModelRequest("replay", "s", with_offload()), step=2)
    assert second.tool_calls == [{"type": "tool-call", "toolCallId": "call_2_1", "toolName": "fs_read",
                                  "input": {"uri": URI}}]
    with pytest.raises(ProviderError, match="3 steps; step 4"):
        await p.complete(ModelRequest("replay", "s", user_only()), step=4)
    with pytest.raises(ProviderError, match=">= 1"):
        await p.complete(ModelRequest("replay", "s", user_only()), step=0)


async def test_inference_and_the_runners_pinned_step_index_still_work():
    p = ReplayProvider(SCRIPT)
    first = await p.complete(ModelRequest("replay", "s", user_only()))
    assert [c["toolCallId"] for c in first.tool_calls] == ["call_1_1", "call_1_2"]
    p._step_index = lambda _messages, k=2: k  # what the runner's pin_replay_step does today
    assert (await p.complete(ModelRequest("replay", "s", user_only()))).parts == [{"type": "text", "text": "Done."}]


async def test_recorded_outputs_are_returned_for_the_calls_the_replay_produced():
    p = ReplayProvider(SCRIPT)
    first = await p.complete(ModelRequest("replay", "s", user_only()), step=1)
    ids = [c["toolCallId"] for c in first.tool_calls]
    assert [p.recorded_output(i) for i in ids] == [{"type": "text", "value": "a.txt\nb.txt\n"},
                                                   {"type": "error-text", "value": "exit 1"}]
    assert "output" not in first.tool_calls[0]  # the model's decision does not leak the recorded result
    assert p.recorded_output("call_2_1") is None  # a call with no recorded output: the tool really runs
    assert p.recorded_output("call_9_1") is None and p.recorded_output("call_1_3") is None
    assert p.recorded_output("toolu_123") is None


async def test_text_is_handed_to_on_text_once():
    seen: list[str] = []

    async def on_text(delta: str) -> None:
        seen.append(delta)

    await ReplayProvider(SCRIPT).complete(ModelRequest("replay", "s", user_only()), step=1, on_text=on_text)
    assert seen == ["Reading."]


def test_recorded_tools_become_tool_specs():
    p = ReplayProvider(SCRIPT, tools=[
        {"name": "bash", "description": "run a command", "inputSchema": {
            "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
        {"name": "submit"}])
    assert p.recorded_tools == [
        ToolSpec("bash", "run a command", {"type": "object", "properties": {"command": {"type": "string"}},
                                           "required": ["command"]}),
        ToolSpec("submit", "", {"type": "object"})]
    assert ReplayProvider(SCRIPT).recorded_tools == []


@pytest.mark.parametrize(("script", "tools", "message"), [
    ([], None, "empty replay script"),
    ([{"say": "hi"}], None, "step 1: expected"),
    ([{"toolCalls": {"toolName": "x"}}], None, "toolCalls must be a list"),
    ([{"toolCalls": [{"input": {}}]}], None, "step 1 call 1: toolName"),
    ([{"text": "a"}, {"toolCalls": [{"toolName": "x", "input": "ls"}]}], None, "step 2 call 1: input"),
    ([{"toolCalls": [{"toolName": "x", "output": "plain"}]}], None, "output must be"),
    ([{"toolCalls": [{"toolName": "x", "output": {"type": "html", "value": ""}}]}], None, "output must be"),
    ([{"text": "a"}], [{"description": "no name"}], "name is required"),
    ([{"text": "a"}], [{"name": "t", "inputSchema": {"type": "string"}}], "object schema"),
])
def test_bad_scripts_fail_at_construction_with_a_typed_error(script, tools, message):
    with pytest.raises(ProviderError, match=message):
        ReplayProvider(script, tools=tools)


async def test_call_ids_carry_the_prefix_and_recorded_outputs_follow_it():
    """The runner gives each turn its own prefix, so a replayed conversation never repeats a call id."""
    from ctxbuild_providers import ModelRequest, ReplayProvider

    script = [{"toolCalls": [{"toolName": "bash", "input": {}, "output": {"type": "text", "value": "r1"}}]}]
    p = ReplayProvider(script, call_id_prefix="call_ab12cd34")
    resp = await p.complete(ModelRequest(model="m", system="", messages=[]), step=1)
    cid = resp.tool_calls[0]["toolCallId"]
    assert cid == "call_ab12cd34_1_1"
    assert p.recorded_output(cid) == {"type": "text", "value": "r1"}
    assert p.recorded_output("call_1_1") is None  # another turn's id is not this replay's
