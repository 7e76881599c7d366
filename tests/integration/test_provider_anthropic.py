"""The Anthropic Messages adapter (real `anthropic` SDK) against a local server that enforces the wire rules,
streamed (SSE events) and not."""

from __future__ import annotations

import pytest
from ctxbuild_devstack import free_port
from ctxbuild_providers import AnthropicMessagesProvider, ModelRequest, ProviderError, ToolSpec

from tests.support.fake_anthropic import FakeAnthropic
from tests.support.server import serving
from tests.support.text_deltas import Deltas

pytestmark = pytest.mark.integration

TOOL = ToolSpec("lookup", "look something up", {"type": "object", "properties": {"q": {"type": "integer"}}})
USER = {"id": "u", "role": "user", "parts": [{"type": "text", "text": "hello"}]}


@pytest.fixture
def fake():
    """Per test: the fake's cache answer depends on how many requests it has seen."""
    yield from serving(FakeAnthropic(free_port()))


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_tool_use_round_trip_with_cache_breakpoints(fake, stream):
    p = AnthropicMessagesProvider("claude-fake", api_key="k", base_url=fake.base_url, max_retries=0, stream=stream)
    deltas = Deltas()
    first = await p.complete(ModelRequest("claude-fake", "system prompt", [USER], [TOOL]), on_text=deltas)
    assert first.stop_reason == "tool_calls"
    assert first.parts == [{"type": "text", "text": "let me look"},
                           {"type": "tool-call", "toolCallId": "toolu_1", "toolName": "lookup", "input": {"q": 1}}]
    assert "".join(deltas) == "let me look" and (len(deltas) > 1) is stream
    # input_tokens (50) is the uncached tail: the prompt also holds the 400 tokens written to the cache
    assert first.usage == {"inputTokens": 450, "outputTokens": 9, "cacheReadTokens": 0, "cacheWriteTokens": 400}

    history = [USER, {"id": "a", "role": "assistant", "parts": first.parts},
               {"id": "t", "role": "tool", "parts": [{"type": "tool-result", "toolCallId": "toolu_1",
                                                      "toolName": "lookup",
                                                      "output": {"type": "error-text", "value": "[Error: x] no"}}]}]
    second = await p.complete(ModelRequest("claude-fake", "system prompt", history, [TOOL]))
    assert second.parts == [{"type": "text", "text": "got 1 result(s)"}] and second.stop_reason == "stop"
    assert second.usage == {"inputTokens": 450, "outputTokens": 9, "cacheReadTokens": 400, "cacheWriteTokens": 0}

    wire = fake.requests[-1]
    assert wire.get("stream", False) is stream
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


async def test_malformed_streamed_tool_input_is_a_typed_error(fake):
    p = AnthropicMessagesProvider("claude-fake", api_key="k", base_url=fake.base_url, max_retries=0)
    fake.reply_next = [{"type": "tool_use", "id": "toolu_x", "name": "lookup", "raw_input": '{"q": 1,'}]
    with pytest.raises(ProviderError) as err:
        await p.complete(ModelRequest("claude-fake", "", [USER], [TOOL]))
    assert "lookup" in str(err.value) and "invalid JSON" in str(err.value) and not err.value.retryable


@pytest.mark.parametrize(("fault", "says"), [("cut", "message_stop"), ("drop", "RemoteProtocolError"),
                                             ("overloaded", "overloaded_error")])
async def test_a_broken_stream_is_a_retryable_provider_error(fake, fault, says):
    p = AnthropicMessagesProvider("claude-fake", api_key="k", base_url=fake.base_url, max_retries=0)
    fake.break_next = fault
    with pytest.raises(ProviderError) as err:
        await p.complete(ModelRequest("claude-fake", "", [USER], [TOOL]))
    assert err.value.retryable and says in str(err.value)


async def test_overloaded_status_is_retryable_and_the_sdk_retries_are_configurable(fake):
    fake.fail_next = 529
    with pytest.raises(ProviderError) as err:
        await AnthropicMessagesProvider("claude-fake", api_key="k", base_url=fake.base_url, max_retries=0).complete(
            ModelRequest("claude-fake", "", [USER], [TOOL]))
    assert err.value.retryable and err.value.status == 529
    fake.fail_next = 529
    before = len(fake.requests)
    retrying = AnthropicMessagesProvider("claude-fake", api_key="k", base_url=fake.base_url, max_retries=1)
    r = await retrying.complete(ModelRequest("claude-fake", "", [USER], [TOOL]))
    assert r.stop_reason == "tool_calls" and len(fake.requests) == before + 2


async def test_a_whole_answer_may_take_longer_than_the_wait_between_events(fake):
    """Not streamed, nothing arrives before the whole answer is written: the call waits whole_answer_timeout_s,
    not the client's timeout (which a stream meets between events)."""
    def provider(whole_answer_timeout_s: float) -> AnthropicMessagesProvider:
        return AnthropicMessagesProvider("claude-fake", api_key="k", base_url=fake.base_url, max_retries=0,
                                         timeout_s=0.3, stream=False, whole_answer_timeout_s=whole_answer_timeout_s)

    fake.delay_next_s = 1.0
    answer = await provider(10.0).complete(ModelRequest("claude-fake", "system prompt", [USER], [TOOL]))
    assert answer.parts
    fake.delay_next_s = 1.0
    with pytest.raises(ProviderError) as timed_out:  # the same wait past a short whole-answer timeout
        await provider(0.3).complete(ModelRequest("claude-fake", "system prompt", [USER], [TOOL]))
    assert timed_out.value.retryable
