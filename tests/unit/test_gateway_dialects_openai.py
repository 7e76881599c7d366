"""The gateway's OpenAI Chat Completions dialect: requests → the neutral form, results → bodies and SSE that the
official `openai` SDK's own types and stream parsers accept (a real client reading our bytes over an
httpx.MockTransport: a client-side check of the wire format)."""

import json

import httpx
import openai
import pytest
from ctxbuild_orchestration.domain.gateway import (
    DialectError,
    GatewayResult,
    OpenAIStream,
    openai_completion,
    openai_error,
    openai_error_type,
    parse_openai,
    sse_comment,
)
from ctxbuild_platform import contracts
from openai.types.chat import ChatCompletion, ChatCompletionChunk

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def _body(**kw):
    return {"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}], **kw}


def _parts_valid(req):
    for m in req.messages:
        assert m["role"] in ("user", "assistant", "tool") and m["parts"]
        for part in m["parts"]:
            contracts.validate("model/part.json", part)
    return req


def _refused(body, param=None):
    with pytest.raises(DialectError) as e:
        parse_openai(body)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    if param is not None:
        assert e.value.param == param
    return e.value


def test_string_and_part_array_content_and_system_developer_joined():
    req = _parts_valid(parse_openai({"model": "gpt-x", "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "developer", "content": [{"type": "text", "text": "Answer in French."}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}], "name": "bot"},
        {"role": "user", "content": "next"}]}))
    assert req.dialect == "openai" and req.model == "gpt-x"
    assert req.system == "You are terse.\n\nAnswer in French."
    assert req.messages == [
        {"role": "user", "parts": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "parts": [{"type": "text", "text": "ok"}]},
        {"role": "user", "parts": [{"type": "text", "text": "next"}]}]
    assert req.tools == [] and req.tool_choice is None and req.stream is False and req.include_usage is False


def test_assistant_tool_calls_and_tool_messages_take_the_calls_name():
    req = _parts_valid(parse_openai(_body(messages=[
        {"role": "user", "content": "weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "rain "},
                                                                {"type": "text", "text": "all day"}]}],
        tools=[WEATHER])))
    assert req.messages[1] == {"role": "assistant", "parts": [
        {"type": "tool-call", "toolCallId": "call_1", "toolName": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool-call", "toolCallId": "call_2", "toolName": "get_weather", "input": {}}]}
    assert req.messages[2:] == [
        {"role": "tool", "parts": [{"type": "tool-result", "toolCallId": "call_1", "toolName": "get_weather",
                                    "output": {"type": "text", "value": "sunny"}}]},
        {"role": "tool", "parts": [{"type": "tool-result", "toolCallId": "call_2", "toolName": "get_weather",
                                    "output": {"type": "text", "value": "rain all day"}}]}]


def test_malformed_arguments_are_kept_verbatim_not_refused():
    req = parse_openai(_body(messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": "{oops"}}]}]))
    assert req.messages[1]["parts"][0]["input"] == "{oops"
    done = openai_completion(GatewayResult("", [{"toolCallId": "c", "toolName": "f", "input": "{oops"}],
                                           "tool_calls", {}), id="x", model="m", created=1)
    assert done["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == "{oops"


def test_a_tool_message_without_a_matching_call_is_refused():
    e = _refused(_body(messages=[{"role": "user", "content": "x"},
                                 {"role": "tool", "tool_call_id": "nope", "content": "r"}]),
                 "messages[1].tool_call_id")
    assert "nope" in e.message


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]}, "messages[0].content[0]"),
    ({"model": "m", "messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
    (_body(stream_options={"include_usage": True}), "stream_options"),
    (_body(tool_choice="required"), "tool_choice"),
    (_body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "other"}}), "tool_choice"),
    (_body(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
    (_body(tools=[{"type": "custom", "custom": {"name": "x"}}]), "tools[0]"),
    (_body(tools=[WEATHER, WEATHER]), "tools[1].function.name"),
    (_body(max_tokens=0), "max_tokens"),
    (_body(n=2), "n"),
    (_body(parallel_tool_calls="yes"), "parallel_tool_calls"),
    (_body(metadata={"conversation_id": 5}), "metadata.conversation_id"),
])
def test_invalid_requests_are_refused_with_the_field_named(body, param):
    _refused(body, param)


def test_images_are_refused_with_a_clear_reason():
    e = _refused({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]})
    assert "image_url" in e.message and "not supported" in e.message


def test_tools_choice_parallel_stream_usage_max_tokens_metadata_and_options():
    req = parse_openai(_body(
        tools=[WEATHER, {"type": "function", "function": {"name": "noop"}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False,
        stream=True, stream_options={"include_usage": True}, max_tokens=50, max_completion_tokens=70,
        metadata={"conversation_id": "conv-1", "app": "x"}, temperature=0.2, stop=["\n"], seed=7))
    assert [t.name for t in req.tools] == ["get_weather", "noop"]
    assert req.tools[0].description == "weather in a city"
    assert req.tools[0].input_schema == WEATHER["function"]["parameters"]
    assert req.tools[1].input_schema == {"type": "object", "properties": {}}
    assert req.tool_choice == {"type": "tool", "name": "get_weather"}
    assert req.parallel_tool_calls is False and req.stream is True and req.include_usage is True
    assert req.max_tokens == 70  # max_completion_tokens wins over the deprecated max_tokens
    assert req.conversation_id == "conv-1"
    assert req.options == {"temperature": 0.2, "stop": ["\n"], "seed": 7}
    for wire, neutral in [("auto", "auto"), ("none", "none"), ("required", "required")]:
        assert parse_openai(_body(tools=[WEATHER], tool_choice=wire)).tool_choice == {"type": neutral}
    assert parse_openai(_body(tool_choice="none")).tool_choice == {"type": "none"}  # none needs no tools
    assert parse_openai(_body(max_tokens=9)).max_tokens == 9


USAGE = {"inputTokens": 1200, "outputTokens": 30, "cacheReadTokens": 1000}
CALLS = [{"toolCallId": "call_a", "toolName": "get_weather", "input": {"city": "Paris"}},
         {"toolCallId": "call_b", "toolName": "get_weather", "input": {"city": "Rome", "unit": "°C"}}]


def test_completion_validates_as_the_sdks_chat_completion():
    body = openai_completion(GatewayResult("Bonjour", [], "stop", USAGE), id="chatcmpl-1", model="gpt-x",
                             created=1700000000)
    done = ChatCompletion.model_validate(body)
    assert done.choices[0].message.content == "Bonjour" and done.choices[0].finish_reason == "stop"
    assert done.usage.prompt_tokens == 1200 and done.usage.total_tokens == 1230
    assert done.usage.prompt_tokens_details.cached_tokens == 1000
    calls = ChatCompletion.model_validate(openai_completion(GatewayResult("", CALLS, "stop", {}), id="c",
                                                            model="m", created=1))
    msg = calls.choices[0].message
    assert msg.content is None and calls.choices[0].finish_reason == "tool_calls"
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("call_a", "get_weather", {"city": "Paris"}), ("call_b", "get_weather", {"city": "Rome", "unit": "°C"})]
    cut = ChatCompletion.model_validate(openai_completion(GatewayResult("Bon", [], "length", {}), id="c",
                                                          model="m", created=1))
    assert cut.choices[0].finish_reason == "length" and cut.usage.prompt_tokens == 0


def _client(payload: bytes, status: int = 200, *, sse: bool = True) -> openai.OpenAI:
    def handler(request: httpx.Request) -> httpx.Response:
        kind = "text/event-stream" if sse else "application/json"
        return httpx.Response(status, content=payload, headers={"content-type": kind})
    return openai.OpenAI(api_key="k", base_url="http://gw.test/v1", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(handler)))


def _stream_bytes(result: GatewayResult, deltas: list[str], include_usage: bool = True) -> bytes:
    s = OpenAIStream(id="chatcmpl-s", model="gpt-x", created=1700000000, include_usage=include_usage)
    out = s.start()
    for d in deltas:
        out += s.text(d)
    out += s.finish(result)
    return b"".join(out)


def test_stream_text_and_usage_through_the_sdks_stream_parser():
    raw = _stream_bytes(GatewayResult("Hello world", [], "stop", USAGE), ["Hel", "lo", " world"])
    assert raw.endswith(b"data: [DONE]\n\n")
    chunks = list(_client(raw).chat.completions.create(model="gpt-x", messages=[{"role": "user", "content": "x"}],
                                                       stream=True, stream_options={"include_usage": True}))
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello world"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 1200
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 1000
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_tool_calls_accumulate_in_the_sdks_stream_helper():
    raw = _stream_bytes(GatewayResult("Let me check.", CALLS, "tool_calls", USAGE), ["Let me ", "check."])
    with _client(raw).chat.completions.stream(model="gpt-x", messages=[{"role": "user", "content": "x"}]) as s:
        final = s.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        (c["toolCallId"], c["toolName"], c["input"]) for c in CALLS]


def test_stream_without_include_usage_has_no_usage_chunk():
    raw = _stream_bytes(GatewayResult("ok", [], "stop", USAGE), ["ok"], include_usage=False)
    chunks = list(_client(raw).chat.completions.create(model="m", messages=[], stream=True))
    assert chunks and all(c.choices and c.usage is None for c in chunks)
    assert b'"usage"' not in raw


def test_finish_sends_the_text_the_deltas_did_not_and_never_twice():
    s = OpenAIStream(id="i", model="m", created=1, include_usage=False)
    out = s.text("Hel") + s.finish(GatewayResult("Hello", [], "stop", {}))
    texts = [json.loads(line[6:])["choices"][0]["delta"].get("content") for line in out
             if not line.startswith(b"data: [DONE]")]
    assert "".join(t or "" for t in texts) == "Hello"
    assert s.finish(GatewayResult("Hello", [], "stop", {})) == [] and s.text("late") == []


def test_stream_error_raises_in_the_sdk():
    s = OpenAIStream(id="i", model="m", created=1, include_usage=False)
    raw = b"".join(s.start() + s.text("par") + s.error(502, "server_error", "upstream failed"))
    with pytest.raises(openai.APIError, match="upstream failed"):
        list(_client(raw).chat.completions.create(model="m", messages=[], stream=True))


@pytest.mark.parametrize(("status", "cls"), [(400, openai.BadRequestError), (401, openai.AuthenticationError),
                                             (404, openai.NotFoundError), (429, openai.RateLimitError),
                                             (502, openai.InternalServerError)])
def test_error_body_is_read_by_the_sdk(status, cls):
    body = openai_error(status, openai_error_type(status), "no such thing", param="model", code="x_code")
    assert set(body["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(cls) as e:
        _client(json.dumps(body).encode(), status, sse=False).chat.completions.create(model="m", messages=[])
    assert e.value.status_code == status and e.value.code == "x_code" and e.value.param == "model"
    assert e.value.type == openai_error_type(status) and "no such thing" in str(e.value)


def test_error_types_per_status():
    assert openai_error_type(400) == "invalid_request_error"
    assert openai_error_type(429) == "rate_limit_error"
    assert openai_error_type(503) == "server_error"


def _async_client(payload: bytes) -> openai.AsyncOpenAI:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=payload, headers={"content-type": "text/event-stream"})
    return openai.AsyncOpenAI(api_key="k", base_url="http://gw.test/v1", max_retries=0,
                              http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))


async def test_pings_and_a_trailing_comment_pass_the_async_sdk_unseen():
    s = OpenAIStream(id="i", model="m", created=1, include_usage=True)
    raw = b"".join(s.ping() + s.start() + s.text("a") + s.ping() + s.text("b")
                   + s.finish(GatewayResult("ab", CALLS[:1], "tool_calls", USAGE)) + [sse_comment("overhead-ms 12")])
    assert s.ping() == []  # nothing after the end
    stream = await _async_client(raw).chat.completions.create(model="m", messages=[], stream=True,
                                                              stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "ab"
    assert [c.choices[0].delta.tool_calls[0].function.name for c in chunks
            if c.choices and c.choices[0].delta.tool_calls] == ["get_weather"]
    assert chunks[-1].usage.completion_tokens == 30


def test_sse_comment_is_one_frame_even_for_several_lines():
    assert sse_comment("a\nb") == b": a\n: b\n\n"
