"""Pure parts of the turn runner: which tools are offered, the replay provider, the per-step report."""

import pytest
from ctxbuild_orchestration.domain.steps import step_rows
from ctxbuild_orchestration.domain.tools import offered_tools
from ctxbuild_providers import ModelRequest, ProviderError, ReplayProvider, ToolSpec

MCP = [{"id": "mcp__time__get_current_time_0123456789abcdef0123", "name": "get_current_time",
        "description": "now", "inputSchema": {"type": "object"}}]


def test_read_file_offered_only_with_attachments_from_the_retained_list():
    """Finding #2: read_file follows the authoritative attachment list, not the served rows."""
    with_att = offered_tools({"fileAttachments": [{"handle": "a.log"}], "persistedUris": []}, [], can_offload=True)
    without = offered_tools({"fileAttachments": [], "persistedUris": []}, [], can_offload=True)
    assert [t.name for t in with_att] == ["read_file", "fs_read"]
    assert [t.name for t in without] == []  # fs_read is never the only tool with nothing to read


def test_fs_read_offered_for_archived_outputs_and_mcp_tools_follow():
    names = [t.name for t in offered_tools({"fileAttachments": [], "persistedUris": ["context://vfs/x"]}, MCP, True)]
    assert names == ["fs_read", MCP[0]["id"]]


def _msgs(*roles):
    return [{"id": f"m{i}", "role": r, "parts": []} for i, r in enumerate(roles)]


async def test_replay_plays_steps_in_turn_order_and_fills_uris():
    script = [{"toolCalls": [{"toolName": "fs_read", "input": {"uri": "{{offload_uri:1}}"}}]}, {"text": "done"}]
    p = ReplayProvider(script)
    tool_msg = {"id": "t", "role": "tool", "parts": [{"type": "tool-result", "toolCallId": "c", "toolName": "x",
                "output": {"type": "text", "value": "m"}, "offload": {"uri": "context://vfs/vfs_aaaaaaaaaaaaaaaa.txt",
                                                                      "mode": "offloaded"}}]}
    first = await p.complete(ModelRequest("replay", "sys", [*_msgs("user"), tool_msg]))
    assert first.tool_calls[0]["input"] == {"uri": "context://vfs/vfs_aaaaaaaaaaaaaaaa.txt"}
    assert first.stop_reason == "tool_calls" and first.usage["inputTokens"] > 0
    second = await p.complete(ModelRequest("replay", "sys", _msgs("user", "assistant")))
    assert second.parts == [{"type": "text", "text": "done"}] and second.stop_reason == "stop"
    with pytest.raises(ProviderError):
        await p.complete(ModelRequest("replay", "sys", _msgs("user", "assistant", "assistant")))


async def test_replay_resolves_mcp_tool_names_against_offered_tools():
    p = ReplayProvider([{"toolCalls": [{"toolName": "mcp:time/get_current_time", "input": {}}]}])
    tools = [ToolSpec(MCP[0]["id"], "now", {"type": "object"})]
    r = await p.complete(ModelRequest("replay", "sys", _msgs("user"), tools))
    assert r.tool_calls[0]["toolName"] == MCP[0]["id"]
    with pytest.raises(ProviderError):
        await p.complete(ModelRequest("replay", "sys", _msgs("user"), []))


def test_request_rendering_is_byte_stable():
    a = ModelRequest("m", "s", [{"id": "1", "role": "user", "parts": [{"type": "text", "text": "é"}]}])
    b = ModelRequest("m", "s", [{"id": "1", "role": "user", "parts": [{"type": "text", "text": "é"}]}])
    assert a.render() == b.render() and a.digest() == b.digest()
    assert "é".encode() in a.render()


def test_step_rows_count_trims_and_carry_the_compaction_decision():
    ev = [
        {"type": "CompactionDecided", "data": {"phase": "turn-start", "status": "skipped", "reason": "under-trigger"}},
        {"type": "StepServed", "data": {"step": 1, "servedTokens": 100, "messagesServed": 2, "requestHash": "ab" * 32}},
        {"type": "ToolCallRequested", "data": {"step": 1, "toolName": "read_file"}},
        {"type": "ToolResultRecorded", "data": {"step": 1, "trimmed": True, "offload": {"mode": "offloaded"}}},
        {"type": "StepServed", "data": {"step": 2, "servedTokens": 300, "messagesServed": 4, "requestHash": "cd" * 32}},
    ]
    rows = step_rows(ev)
    assert rows[0]["compaction"] == "skipped: under-trigger" and rows[1]["compaction"] == "-"
    assert (rows[0]["trimmed"], rows[0]["offloaded"], rows[0]["tools"]) == (1, 1, ["read_file"])
    assert rows[1]["servedTokens"] == 300

