"""The OpenAI-compatible adapter (real `openai` SDK) against a local server speaking the chat-completions wire
format, streamed (SSE chunks, usage last) and not."""

from __future__ import annotations

import pytest
from ctxbuild_devstack import free_port
from ctxbuild_providers import ModelRequest, OpenAIChatProvider, ProviderError, ToolSpec

from tests.support.fake_openai import FakeOpenAI
from tests.support.server import serving
from tests.support.text_deltas import Deltas

pytestmark = pytest.mark.integration

READ_FILE = ToolSpec("read_file", "read an attachment", {"type": "object", "properties": {
    "filename": {"type": "string"}}, "required": ["filename"]})
USER = {"id": "u1", "role": "user", "parts": [
    {"type": "text", "text": "read it"},
    {"type": "file", "handle": "notes.txt", "displayName": "notes.txt", "mediaType": "text/plain", "sha256": "a" * 64}]}
HI = [{"id": "u", "role": "user", "parts": [{"type": "text", "text": "hi"}]}]


@pytest.fixture(scope="module")
def fake():
    yield from serving(FakeOpenAI(free_port()))


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_tool_call_round_trip_on_the_wire(fake, stream):
    provider = OpenAIChatProvider("fake-model", base_url=fake.base_url, api_key=None, max_retries=0, stream=stream)
    first = await provider.complete(ModelRequest("fake-model", "be brief", [USER], [READ_FILE]))
    assert first.stop_reason == "tool_calls"
    call = first.tool_calls[0]
    assert call["toolName"] == "read_file" and call["input"] == {"filename": "notes.txt", "limit": 500}
    assert first.usage["inputTokens"] > 0 and first.usage["cacheReadTokens"] == first.usage["inputTokens"] // 2
    assert all(type(v) is int for v in first.usage.values())

    assistant = {"id": "a1", "role": "assistant", "parts": first.parts}
    tool = {"id": "t1", "role": "tool", "parts": [{"type": "tool-result", "toolCallId": call["toolCallId"],
                                                   "toolName": "read_file",
                                                   "output": {"type": "text", "value": "x" * 42}}]}
    deltas = Deltas()
    second = await provider.complete(ModelRequest("fake-model", "be brief", [USER, assistant, tool], [READ_FILE]),
                                     on_text=deltas)
    assert second.parts == [{"type": "text", "text": "I read 42 characters."}] and second.stop_reason == "stop"
    # streamed: the text arrives in pieces as the server sends them; whole: in one
    assert "".join(deltas) == "I read 42 characters." and (len(deltas) > 1) is stream

    wire = fake.requests[-1]
    assert [m["role"] for m in wire["messages"]] == ["system", "user", "assistant", "tool"]
    assert wire["messages"][2]["tool_calls"][0]["function"] == {
        "name": "read_file", "arguments": '{"filename":"notes.txt","limit":500}'}
    assert wire["messages"][3] == {"role": "tool", "tool_call_id": call["toolCallId"], "content": "x" * 42}
    assert wire["tools"][0]["function"]["parameters"] == READ_FILE.input_schema
    if stream:
        assert wire["stream"] is True and wire["stream_options"] == {"include_usage": True}
    else:
        assert "stream" not in wire


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize(("arguments", "why"), [('{"filename": "notes', "invalid JSON"),
                                                ('["notes.txt"]', "not a JSON object")])
async def test_malformed_tool_call_arguments_are_a_typed_error(fake, stream, arguments, why):
    provider = OpenAIChatProvider("fake-model", base_url=fake.base_url, api_key=None, max_retries=0, stream=stream)
    fake.reply_next = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_x", "type": "function", "function": {"name": "read_file", "arguments": arguments}}]}
    with pytest.raises(ProviderError) as err:
        await provider.complete(ModelRequest("fake-model", "", [USER], [READ_FILE]))
    assert "read_file" in str(err.value) and why in str(err.value) and not err.value.retryable


@pytest.mark.parametrize(("status", "retryable"), [(503, True), (429, True), (400, False)])
async def test_http_errors_become_typed_provider_errors(fake, status, retryable):
    provider = OpenAIChatProvider("fake-model", base_url=fake.base_url, api_key="k", max_retries=0)
    fake.fail_next = status
    with pytest.raises(ProviderError) as err:
        await provider.complete(ModelRequest("fake-model", "", HI))
    assert err.value.retryable is retryable and err.value.status == status and f"HTTP {status}" in str(err.value)


async def test_the_sdks_own_retries_stay_configurable(fake):
    before = len(fake.requests)
    fake.fail_next = 503
    retrying = OpenAIChatProvider("fake-model", base_url=fake.base_url, api_key="k", max_retries=1)
    r = await retrying.complete(ModelRequest("fake-model", "", HI))
    assert r.parts == [{"type": "text", "text": "I read 0 characters."}] and len(fake.requests) == before + 2


@pytest.mark.parametrize(("fault", "says"), [("cut", "ended before"), ("drop", "APIConnectionError"),
                                             ("error", "the model crashed")])
async def test_a_broken_stream_is_a_retryable_provider_error(fake, fault, says):
    provider = OpenAIChatProvider("fake-model", base_url=fake.base_url, api_key="k", max_retries=0)
    fake.break_next = fault
    with pytest.raises(ProviderError) as err:
        await provider.complete(ModelRequest("fake-model", "", HI))
    assert err.value.retryable and says in str(err.value)


async def test_an_unreachable_server_is_retryable():
    provider = OpenAIChatProvider("m", base_url=f"http://127.0.0.1:{free_port()}/v1", api_key="k", max_retries=0)
    with pytest.raises(ProviderError) as err:
        await provider.complete(ModelRequest("m", "", HI))
    assert err.value.retryable and err.value.status is None


async def test_a_whole_answer_may_take_longer_than_the_wait_between_chunks(fake):
    """Not streamed, nothing arrives before the whole answer is written: the call waits whole_answer_timeout_s,
    not the client's timeout (which a stream meets between chunks)."""
    def provider(whole_answer_timeout_s: float) -> OpenAIChatProvider:
        return OpenAIChatProvider("fake-model", base_url=fake.base_url, api_key=None, max_retries=0, timeout_s=0.3,
                                  stream=False, whole_answer_timeout_s=whole_answer_timeout_s)

    fake.delay_next_s = 1.0
    answer = await provider(10.0).complete(ModelRequest("fake-model", "be brief", HI))
    assert answer.stop_reason == "stop" and answer.parts
    fake.delay_next_s = 1.0
    with pytest.raises(ProviderError) as timed_out:  # the same wait past a short whole-answer timeout
        await provider(0.3).complete(ModelRequest("fake-model", "be brief", HI))
    assert timed_out.value.retryable
