"""The Anthropic Messages adapter against a local server that enforces the wire rules."""

from __future__ import annotations

import pytest
from ctxbuild_devstack import free_port
from ctxbuild_providers import AnthropicMessagesProvider, ModelRequest, ProviderError, ToolSpec

from tests.support.fake_anthropic import FakeAnthropic

pytestmark = pytest.mark.integration

TOOL = ToolSpec("lookup", "look something up", {"type": "object", "properties": {"q": {"type": "integer"}}})


@pytest.fixture(scope="module")
def fake():
    server = FakeAnthropic(free_port()).start()
    yield server
    server.stop()


async def test_tool_use_round_trip_with_cache_breakpoints(fake):
    p = AnthropicMessagesProvider("claude-fake", api_key="k", base_url=fake.base_url, max_retries=0)
    user = {"id": "u", "role": "user", "parts": [{"type": "text", "text": "hello"}]}
    first = await p.complete(ModelRequest("claude-fake", "system prompt", [user], [TOOL]))
    assert first.stop_reason == "tool_calls"
    assert first.parts[1] == {"type": "tool-call", "toolCallId": "toolu_1", "toolName": "lookup", "input": {"q": 1}}
    assert first.usage == {"inputTokens": 50, "outputTokens": 9, "cacheWriteTokens": 400}

    history = [user, {"id": "a", "role": "assistant", "parts": first.parts},
               {"id": "t", "role": "tool", "parts": [{"type": "tool-result", "toolCallId": "toolu_1",
                                                      "toolName": "lookup",
                                                      "output": {"type": "error-text", "value": "[Error: x] no"}}]}]
    second = await p.complete(ModelRequest("claude-fake", "system prompt", history, [TOOL]))
    assert second.parts == [{"type": "text", "text": "got 1 result(s)"}] and second.usage["cacheReadTokens"] == 400

    wire = fake.requests[-1]
    assert [m["role"] for m in wire["messages"]] == ["user", "assistant", "user"]
    assert wire["messages"][2]["content"][0] == {"type": "tool_result", "tool_use_id": "toolu_1",
                                                 "content": "[Error: x] no", "is_error": True,
                                                 "cache_control": {"type": "ephemeral"}}
    assert wire["system"][0]["cache_control"] == {"type": "ephemeral"}
    assert wire["tools"][-1]["cache_control"] == {"type": "ephemeral"}


async def test_wire_rule_violations_surface_as_provider_errors(fake):
    p = AnthropicMessagesProvider("claude-fake", api_key="k", base_url=fake.base_url, max_retries=0)
    orphan = [{"id": "u", "role": "user", "parts": [{"type": "tool-result", "toolCallId": "nope", "toolName": "x",
                                                     "output": {"type": "text", "value": "?"}}]}]
    with pytest.raises(ProviderError) as err:
        await p.complete(ModelRequest("claude-fake", "", orphan, [TOOL]))
    assert "400" in str(err.value) and not err.value.retryable
