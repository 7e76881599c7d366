"""The OpenAI-compatible adapter against a local server speaking the chat-completions wire format."""

from __future__ import annotations

import pytest
from ctxbuild_devstack import free_port
from ctxbuild_providers import ModelRequest, OpenAIChatProvider, ProviderError, ToolSpec

from tests.support.fake_openai import FakeOpenAI

pytestmark = pytest.mark.integration

READ_FILE = ToolSpec("read_file", "read an attachment", {"type": "object", "properties": {
    "filename": {"type": "string"}}, "required": ["filename"]})


@pytest.fixture(scope="module")
def fake():
    server = FakeOpenAI(free_port()).start()
    yield server
    server.stop()


async def test_tool_call_round_trip_on_the_wire(fake):
    provider = OpenAIChatProvider("fake-model", base_url=fake.base_url, api_key=None, max_retries=0)
    user = {"id": "u1", "role": "user", "parts": [
        {"type": "text", "text": "read it"},
        {"type": "file", "handle": "notes.txt", "displayName": "notes.txt", "mediaType": "text/plain",
         "sha256": "a" * 64}]}
    first = await provider.complete(ModelRequest("fake-model", "be brief", [user], [READ_FILE]))
    assert first.stop_reason == "tool_calls"
    call = first.tool_calls[0]
    assert call["toolName"] == "read_file" and call["input"] == {"filename": "notes.txt", "limit": 500}
    assert first.usage["inputTokens"] > 0 and first.usage["cacheReadTokens"] == first.usage["inputTokens"] // 2

    assistant = {"id": "a1", "role": "assistant", "parts": first.parts}
    tool = {"id": "t1", "role": "tool", "parts": [{"type": "tool-result", "toolCallId": call["toolCallId"],
                                                   "toolName": "read_file",
                                                   "output": {"type": "text", "value": "x" * 42}}]}
    second = await provider.complete(ModelRequest("fake-model", "be brief", [user, assistant, tool], [READ_FILE]))
    assert second.parts == [{"type": "text", "text": "I read 42 characters."}]

    wire = fake.requests[-1]
    assert [m["role"] for m in wire["messages"]] == ["system", "user", "assistant", "tool"]
    assert wire["messages"][2]["tool_calls"][0]["function"] == {
        "name": "read_file", "arguments": '{"filename":"notes.txt","limit":500}'}
    assert wire["messages"][3] == {"role": "tool", "tool_call_id": call["toolCallId"], "content": "x" * 42}
    assert wire["tools"][0]["function"]["parameters"] == READ_FILE.input_schema


async def test_http_errors_become_typed_provider_errors(fake):
    provider = OpenAIChatProvider("fake-model", base_url=fake.base_url, api_key="k", max_retries=0)
    fake.fail_next = 503
    with pytest.raises(ProviderError) as err:
        await provider.complete(ModelRequest("fake-model", "", [{"id": "u", "role": "user",
                                                                  "parts": [{"type": "text", "text": "hi"}]}]))
    assert err.value.retryable and "503" in str(err.value)
