"""The gateway's Anthropic Messages dialect: requests → the neutral form, results → bodies and SSE events that
the official `anthropic` SDK's own types and stream accumulator accept (a real client reading our bytes over an
httpx2.MockTransport (the transport package this SDK uses): a client-side check of the wire format)."""

import json

import anthropic
import httpx2
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from ctxbuild_codec.nontext import has_nontext
from ctxbuild_orchestration.domain.gateway import (
    AnthropicStream,
    DialectError,
    GatewayResult,
    anthropic_error,
    anthropic_error_type,
    anthropic_message,
    parse_anthropic,
    sse_comment,
)
from ctxbuild_platform import contracts
from pydantic import TypeAdapter

WEATHER = {"name": "get_weather", "description": "weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _body(**kw):
    return {"model": "claude-x", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}], **kw}


def _parts_valid(req):
    for m in req.messages:
        assert m["role"] in ("user", "assistant", "tool") and m["parts"]
        for part in m["parts"]:
            contracts.validate("model/part.json", part)
    return req


def _refused(body, *words):
    with pytest.raises(DialectError) as e:
        parse_anthropic(body)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    for w in words:
        assert w in e.value.message
    return e.value


def test_system_string_or_blocks_and_content_string_or_blocks():
    req = _parts_valid(parse_anthropic(_body(
        system=[{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Answer in French."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                  {"role": "assistant", "content": "ok"},
                  {"role": "user", "content": "next"}])))
    assert req.dialect == "anthropic" and req.model == "claude-x" and req.max_tokens == 100
    assert req.system == "You are terse.\n\nAnswer in French."
    assert req.messages == [
        {"role": "user", "parts": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "parts": [{"type": "text", "text": "ok"}]},
        {"role": "user", "parts": [{"type": "text", "text": "next"}]}]
    assert req.include_usage is True and req.stream is False and req.tool_choice is None
    assert parse_anthropic(_body(system="plain")).system == "plain"
    assert parse_anthropic(_body()).system is None


def test_tool_use_and_tool_results_split_into_tool_messages_first_then_the_text():
    req = _parts_valid(parse_anthropic(_body(tools=[WEATHER], messages=[
        {"role": "user", "content": "weather in Paris and Rome?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "two calls", "signature": "sig"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "here you go"},
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "service "}, {"type": "text", "text": "down"}]}]}])))
    assert req.messages[1] == {"role": "assistant", "parts": [  # thinking without its signature is dropped
        {"type": "text", "text": "Checking."},
        {"type": "tool-call", "toolCallId": "toolu_1", "toolName": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool-call", "toolCallId": "toolu_2", "toolName": "get_weather", "input": {"city": "Rome"}}]}
    assert req.messages[2:] == [
        {"role": "tool", "parts": [{"type": "tool-result", "toolCallId": "toolu_1", "toolName": "get_weather",
                                    "output": {"type": "text", "value": "sunny"}}]},
        {"role": "tool", "parts": [{"type": "tool-result", "toolCallId": "toolu_2", "toolName": "get_weather",
                                    "output": {"type": "error-text", "value": "service down"}}]},
        {"role": "user", "parts": [{"type": "text", "text": "here you go"}]}]


def test_a_tool_result_alone_makes_no_empty_user_message_and_missing_content_is_empty():
    req = parse_anthropic(_body(messages=[
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "noop", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]))
    assert [m["role"] for m in req.messages] == ["user", "assistant", "tool"]
    assert req.messages[2]["parts"][0]["output"] == {"type": "text", "value": ""}


def test_images_in_a_tool_result_keep_every_block_in_a_content_output():
    """A screenshot tool's result is not refused: a ``content`` output keeps it, the in-flight lane offloads it."""
    req = _parts_valid(parse_anthropic(_body(messages=[
        {"role": "user", "content": "look"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": True, "content": [
            {"type": "text", "text": "the page"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"}},
            {"type": "image", "source": {"type": "url", "url": "https://x.test/a.png"}}]}]}])))
    output = req.messages[2]["parts"][0]["output"]
    assert output == {"type": "content", "metadata": {"isError": True}, "value": [
        {"type": "text", "text": "the page"}, {"type": "image", "data": "iVBORw0K", "mimeType": "image/png"},
        {"type": "resource_link", "uri": "https://x.test/a.png", "name": "image"}]}
    assert has_nontext(output)


@pytest.mark.parametrize(("body", "words"), [
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, ["model"]),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, ["max_tokens"]),
    (_body(messages=[]), ["messages"]),
    (_body(messages=[{"role": "system", "content": "x"}]), ["role"]),
    (_body(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "ghost",
                                                    "content": "r"}]}]), ["ghost", "tool_use"]),
    (_body(messages=[{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AA=="}}]}]), ["image", "not supported"]),
    (_body(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "n", "input": {}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
                         {"type": "image", "source": {"type": "file", "file_id": "f"}}]}]}]), ["source"]),
    (_body(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "n",
                                                    "input": {}}]}]), ["tool_use", "user message"]),
    (_body(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "n",
                                                         "input": "[1]"}]}]), ["input"]),
    (_body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), ["web_search_20250305"]),
    (_body(tools=[{"name": "x"}]), ["input_schema"]),
    (_body(tools=[WEATHER, WEATHER]), ["unique"]),
    (_body(tool_choice={"type": "any"}), ["tools"]),
    (_body(tools=[WEATHER], tool_choice={"type": "tool", "name": "other"}), ["other"]),
    (_body(tools=[WEATHER], tool_choice={"type": "sometimes"}), ["tool_choice"]),
    (_body(stream="yes"), ["stream"]),
    (_body(metadata={"conversation_id": 3}), ["conversation_id"]),
])
def test_invalid_requests_are_refused(body, words):
    _refused(body, *words)


def test_tools_choice_parallel_stream_metadata_and_options():
    req = parse_anthropic(_body(
        tools=[WEATHER, {"name": "noop", "input_schema": {"type": "object"}, "type": "custom"}],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}, stream=True,
        metadata={"user_id": "u1", "conversation_id": "conv-9"}, temperature=0.1, stop_sequences=["END"],
        top_k=5))
    assert [(t.name, t.description) for t in req.tools] == [("get_weather", "weather in a city"), ("noop", "")]
    assert req.tools[0].input_schema == WEATHER["input_schema"]
    assert req.tool_choice == {"type": "tool", "name": "get_weather"} and req.parallel_tool_calls is False
    assert req.stream is True and req.conversation_id == "conv-9"
    assert req.options == {"temperature": 0.1, "stop_sequences": ["END"], "top_k": 5}
    for wire, neutral in [("auto", "auto"), ("any", "required"), ("none", "none")]:
        got = parse_anthropic(_body(tools=[WEATHER], tool_choice={"type": wire,
                                                                  "disable_parallel_tool_use": False}))
        assert got.tool_choice == {"type": neutral} and got.parallel_tool_calls is True
    assert parse_anthropic(_body(tools=[WEATHER], tool_choice={"type": "auto"})).parallel_tool_calls is None


USAGE = {"inputTokens": 1500, "outputTokens": 40, "cacheReadTokens": 1000, "cacheWriteTokens": 300}
CALLS = [{"toolCallId": "toolu_a", "toolName": "get_weather", "input": {"city": "Paris"}},
         {"toolCallId": "toolu_b", "toolName": "get_weather", "input": {"city": "Zürich", "days": [1, 2]}}]


def test_message_validates_as_the_sdks_message():
    msg = Message.model_validate(anthropic_message(GatewayResult("Bonjour", [], "stop", USAGE), id="msg_1",
                                                   model="claude-x"))
    assert msg.content[0].text == "Bonjour" and msg.stop_reason == "end_turn"
    # input_tokens is the uncached tail only: whole prompt − cache reads − cache writes
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (200, 40)
    assert (msg.usage.cache_read_input_tokens, msg.usage.cache_creation_input_tokens) == (1000, 300)
    calls = Message.model_validate(anthropic_message(GatewayResult("Checking.", CALLS, "stop", {}), id="m",
                                                     model="c"))
    assert calls.stop_reason == "tool_use" and calls.content[0].type == "text"
    assert [(b.id, b.name, b.input) for b in calls.content[1:]] == [
        (c["toolCallId"], c["toolName"], c["input"]) for c in CALLS]
    cut = Message.model_validate(anthropic_message(GatewayResult("", [], "length", {}), id="m", model="c"))
    assert cut.stop_reason == "max_tokens" and cut.content == [] and cut.usage.input_tokens == 0


def _client(payload: bytes, status: int = 200, *, sse: bool = True) -> anthropic.Anthropic:
    def handler(request: httpx2.Request) -> httpx2.Response:
        kind = "text/event-stream" if sse else "application/json"
        return httpx2.Response(status, content=payload, headers={"content-type": kind})
    return anthropic.Anthropic(api_key="k", base_url="http://gw.test", max_retries=0,
                               http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))


def _stream_bytes(result: GatewayResult, deltas: list[str]) -> bytes:
    s = AnthropicStream(id="msg_s", model="claude-x")
    out = s.start()
    for d in deltas:
        out += s.text(d)
    return b"".join(out + s.finish(result))


def _events(raw: bytes) -> list:
    adapter = TypeAdapter(RawMessageStreamEvent)
    events = []
    for frame in raw.decode().split("\n\n"):
        if not frame:
            continue
        name, data = frame.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        if payload["type"] != "ping":
            events.append(adapter.validate_python(payload))
    return events


def test_stream_events_validate_and_accumulate_in_the_sdks_message_stream():
    raw = _stream_bytes(GatewayResult("Let me check.", CALLS, "tool_calls", USAGE), ["Let me ", "check."])
    assert [e.type for e in _events(raw)] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop"] + ["content_block_start", "content_block_delta", "content_block_stop"] * 2 + [
        "message_delta", "message_stop"]
    with _client(raw).messages.stream(model="claude-x", max_tokens=10,
                                      messages=[{"role": "user", "content": "x"}]) as s:
        texts = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(texts) == "Let me check."
    assert final.id == "msg_s" and final.stop_reason == "tool_use" and final.content[0].text == "Let me check."
    assert [(b.id, b.name, b.input) for b in final.content[1:]] == [
        (c["toolCallId"], c["toolName"], c["input"]) for c in CALLS]
    assert (final.usage.input_tokens, final.usage.output_tokens) == (200, 40)
    assert (final.usage.cache_read_input_tokens, final.usage.cache_creation_input_tokens) == (1000, 300)


def test_stream_of_only_tool_calls_and_of_a_cut_answer():
    only_calls = _stream_bytes(GatewayResult("", CALLS[:1], "tool_calls", {}), [])
    with _client(only_calls).messages.stream(model="c", max_tokens=5, messages=[]) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["tool_use"] and final.content[0].input == {"city": "Paris"}
    cut = _stream_bytes(GatewayResult("Bon", [], "length", {}), ["Bon"])
    with _client(cut).messages.stream(model="c", max_tokens=5, messages=[]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "max_tokens" and final.content[0].text == "Bon"


def test_raw_stream_through_create_and_finish_sends_only_the_unsent_text():
    s = AnthropicStream(id="m", model="c")
    raw = b"".join(s.text("Hel") + s.finish(GatewayResult("Hello", [], "stop", {"outputTokens": 2})))
    assert s.finish(GatewayResult("Hello", [], "stop", {})) == [] and s.text("late") == []
    events = list(_client(raw).messages.create(model="c", max_tokens=5, messages=[], stream=True))
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == "Hello"
    assert events[-2].usage.output_tokens == 2 and events[-2].delta.stop_reason == "end_turn"


def test_stream_error_raises_in_the_sdk():
    s = AnthropicStream(id="m", model="c")
    raw = b"".join(s.start() + s.text("par") + s.error(529, "overloaded_error", "upstream overloaded"))
    with pytest.raises(anthropic.APIStatusError, match="upstream overloaded"), \
            _client(raw).messages.stream(model="c", max_tokens=5, messages=[]) as stream:
        stream.get_final_message()


@pytest.mark.parametrize(("status", "cls", "kind"), [
    (400, anthropic.BadRequestError, "invalid_request_error"),
    (401, anthropic.AuthenticationError, "authentication_error"),
    (404, anthropic.NotFoundError, "not_found_error"),
    (429, anthropic.RateLimitError, "rate_limit_error"),
    (500, anthropic.InternalServerError, "api_error"),
    (529, anthropic.InternalServerError, "overloaded_error")])
def test_error_body_is_read_by_the_sdk(status, cls, kind):
    assert anthropic_error_type(status) == kind
    body = anthropic_error(status, kind, "not this time")
    assert body == {"type": "error", "error": {"type": kind, "message": "not this time"}}
    with pytest.raises(cls) as e:
        _client(json.dumps(body).encode(), status, sse=False).messages.create(model="c", max_tokens=5,
                                                                               messages=[])
    assert e.value.status_code == status and e.value.body["error"]["type"] == kind


async def test_pings_and_a_trailing_comment_pass_the_async_sdks_message_stream():
    s = AnthropicStream(id="msg_p", model="c")
    raw = b"".join(s.ping() + s.text("a") + s.ping() + s.text("b")
                   + s.finish(GatewayResult("ab", CALLS[1:], "tool_calls", USAGE)) + [sse_comment("overhead-ms 12")])
    assert s.ping() == []

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, content=raw, headers={"content-type": "text/event-stream"})
    client = anthropic.AsyncAnthropic(api_key="k", base_url="http://gw.test", max_retries=0,
                                      http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handler)))
    async with client.messages.stream(model="c", max_tokens=5, messages=[]) as stream:
        final = await stream.get_final_message()
    assert final.content[0].text == "ab" and final.content[1].input == CALLS[1]["input"]
    assert final.stop_reason == "tool_use" and final.usage.cache_read_input_tokens == 1000
