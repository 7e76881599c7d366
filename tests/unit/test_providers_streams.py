"""Pure parts of the real adapters: assembling streamed chunks (OpenAI: their decoded JSON) / events (Anthropic: the
SDK's types) into a ModelResponse, usage normalisation, tool-call argument parsing, and the SDK error →
ProviderError mapping."""

from __future__ import annotations

import anthropic
import httpx
import httpx2
import openai
import pytest
from anthropic.types import RawMessageStreamEvent
from ctxbuild_providers import ProviderError
from ctxbuild_providers.anthropic_messages import MessageStream
from ctxbuild_providers.anthropic_messages import map_error as anthropic_error
from ctxbuild_providers.base import tool_input
from ctxbuild_providers.openai_chat import ChatStream
from ctxbuild_providers.openai_chat import map_error as openai_error
from openai.types.chat import ChatCompletionChunk
from pydantic import TypeAdapter


def chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None) -> dict:
    """A chunk as the adapter gets it (its decoded JSON), checked against the SDK's own type."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    raw = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": choices,
           "usage": usage}
    ChatCompletionChunk.model_validate(raw)
    return raw


def call_frag(index: int, arguments: str, id: str | None = None, name: str | None = None) -> dict:
    fn = {"arguments": arguments, **({"name": name} if name else {})}
    return {"index": index, **({"id": id, "type": "function"} if id else {}), "function": fn}


def test_chat_stream_joins_text_deltas_and_tool_call_fragments():
    s = ChatStream("m")
    deltas = [s.feed(c) for c in [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Let me "}), chunk({"content": "check."}),
        chunk({"tool_calls": [call_frag(0, "", id="call_a", name="read_file")]}),
        chunk({"tool_calls": [call_frag(0, '{"filename": "a'), call_frag(0, '.txt"}')]}),  # two in one chunk
        chunk({"tool_calls": [call_frag(1, '{"q"', id="call_b", name="search"), call_frag(1, ': "x"}')]}),
        chunk({}, "tool_calls"),
        chunk(None, usage={"prompt_tokens": 120, "completion_tokens": 7, "total_tokens": 127,
                           "prompt_tokens_details": {"cached_tokens": 64}}),
    ]]
    assert [d for d in deltas if d] == ["Let me ", "check."]
    r = s.result()
    assert r.parts == [{"type": "text", "text": "Let me check."},
                       {"type": "tool-call", "toolCallId": "call_a", "toolName": "read_file",
                        "input": {"filename": "a.txt"}},
                       {"type": "tool-call", "toolCallId": "call_b", "toolName": "search", "input": {"q": "x"}}]
    assert r.stop_reason == "tool_calls"
    assert r.usage == {"inputTokens": 120, "outputTokens": 7, "cacheReadTokens": 64}


def test_chat_stream_tolerates_a_repeated_name_and_reports_zero_cache_hits():
    s = ChatStream("m")
    for c in [chunk({"tool_calls": [call_frag(0, '{"a":', id="x", name="f")]}),
              chunk({"tool_calls": [call_frag(0, "1}", name="f")]}),  # some servers repeat the name
              chunk({}, "tool_calls"),
              chunk(None, usage={"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6,
                                 "prompt_tokens_details": {"cached_tokens": 0}})]:
        s.feed(c)
    r = s.result()
    assert r.tool_calls == [{"type": "tool-call", "toolCallId": "x", "toolName": "f", "input": {"a": 1}}]
    assert r.usage == {"inputTokens": 5, "outputTokens": 1, "cacheReadTokens": 0}


def test_chat_stream_without_usage_or_finish():
    s = ChatStream("m")
    s.feed(chunk({"content": "hi"}, "stop"))
    assert s.result().usage == {"inputTokens": 0, "outputTokens": 0}  # the server sent no usage chunk
    cut = ChatStream("m")
    cut.feed(chunk({"content": "hi"}))
    with pytest.raises(ProviderError) as err:
        cut.result()
    assert err.value.retryable and "ended before" in str(err.value)


def test_chat_stream_takes_nulls_where_compatible_servers_send_them():
    s = ChatStream("m")
    for c in [{"choices": [{"index": 0, "delta": None, "finish_reason": None}], "usage": None},
              {"choices": [{"index": 0, "delta": {"content": None, "tool_calls": None}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "k", "function": None}]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [
                  {"index": 0, "function": {"name": "f", "arguments": "{}"}}]}}]},
              {"choices": [{"index": 1, "delta": {"content": "another choice"}}]},
              {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "tool_calls"}]},
              {"choices": None, "usage": {"prompt_tokens": 3, "completion_tokens": 2, "prompt_tokens_details": None}}]:
        s.feed(c)
    r = s.result()
    assert r.parts == [{"type": "text", "text": "ok"},
                       {"type": "tool-call", "toolCallId": "k", "toolName": "f", "input": {}}]
    assert r.usage == {"inputTokens": 3, "outputTokens": 2}


def test_chat_stream_malformed_arguments_are_a_typed_error():
    s = ChatStream("m")
    s.feed(chunk({"tool_calls": [call_frag(0, '{"filename": "a.t', id="c", name="read_file")]}, "length"))
    with pytest.raises(ProviderError) as err:
        s.result()
    assert "read_file" in str(err.value) and "invalid JSON" in str(err.value) and not err.value.retryable


EVENT = TypeAdapter(RawMessageStreamEvent)


def events(*raw: dict):
    return [EVENT.validate_python(e) for e in raw]


def start(usage: dict) -> dict:
    return {"type": "message_start", "message": {"id": "m1", "type": "message", "role": "assistant", "model": "c",
                                                 "content": [], "stop_reason": None, "stop_sequence": None,
                                                 "usage": usage}}


def test_message_stream_assembles_blocks_and_normalises_usage():
    s = MessageStream("c")
    deltas = [s.feed(e) for e in events(
        start({"input_tokens": 20, "output_tokens": 1, "cache_read_input_tokens": 300,
               "cache_creation_input_tokens": 12}),
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Look"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "ing."}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1,
         "content_block": {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {}}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"q":'}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": " [1]}"}},
        {"type": "content_block_stop", "index": 1},
        {"type": "content_block_start", "index": 2,
         "content_block": {"type": "tool_use", "id": "toolu_2", "name": "now", "input": {}}},
        {"type": "content_block_stop", "index": 2},  # a no-argument call streams no input_json_delta
        {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
         "usage": {"output_tokens": 33}},
        {"type": "message_stop"})]
    assert [d for d in deltas if d] == ["Look", "ing."]
    r = s.result()
    assert r.parts == [{"type": "text", "text": "Looking."},
                       {"type": "tool-call", "toolCallId": "toolu_1", "toolName": "lookup", "input": {"q": [1]}},
                       {"type": "tool-call", "toolCallId": "toolu_2", "toolName": "now", "input": {}}]
    assert r.stop_reason == "tool_calls"
    # input_tokens is the uncached tail only: the prompt is all three
    assert r.usage == {"inputTokens": 332, "outputTokens": 33, "cacheReadTokens": 300, "cacheWriteTokens": 12}


def test_message_stream_usage_from_message_delta_wins_and_thinking_is_skipped():
    s = MessageStream("c")
    for e in events(
            start({"input_tokens": 5, "output_tokens": 1}),
            {"type": "content_block_start", "index": 0,
             "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
            {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "hmm"}},
            {"type": "content_block_stop", "index": 0},
            {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
            {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "ok"}},
            {"type": "content_block_stop", "index": 1},
            {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
             "usage": {"output_tokens": 4, "input_tokens": 7, "cache_read_input_tokens": 90}},
            {"type": "message_stop"}):
        s.feed(e)
    r = s.result()
    assert r.parts == [{"type": "text", "text": "ok"}] and r.stop_reason == "stop"
    assert r.usage == {"inputTokens": 97, "outputTokens": 4, "cacheReadTokens": 90}


def test_message_stream_malformed_input_and_missing_stop():
    s = MessageStream("c")
    for e in events(
            start({"input_tokens": 5, "output_tokens": 1}),
            {"type": "content_block_start", "index": 0,
             "content_block": {"type": "tool_use", "id": "t", "name": "lookup", "input": {}}},
            {"type": "content_block_delta", "index": 0,
             "delta": {"type": "input_json_delta", "partial_json": '{"q": '}},
            {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
             "usage": {"output_tokens": 4}}):
        s.feed(e)
    with pytest.raises(ProviderError) as cut:
        s.result()
    assert cut.value.retryable and "message_stop" in str(cut.value)
    s.feed(events({"type": "message_stop"})[0])
    with pytest.raises(ProviderError) as bad:
        s.result()
    assert "lookup" in str(bad.value) and "invalid JSON" in str(bad.value) and not bad.value.retryable


def test_tool_input_accepts_objects_only():
    assert tool_input("m", "t", "") == {} and tool_input("m", "t", None) == {}
    assert tool_input("m", "t", {"a": 1}) == {"a": 1} and tool_input("m", "t", '{"a": 1}') == {"a": 1}
    with pytest.raises(ProviderError, match="not a JSON object"):
        tool_input("m", "t", "[1, 2]")
    with pytest.raises(ProviderError, match="invalid JSON"):
        tool_input("m", "t", "{'a': 1}")


def _openai_status(status: int) -> openai.APIStatusError:
    req = httpx.Request("POST", "http://x/v1/chat/completions")
    return openai.APIStatusError("boom", response=httpx.Response(status, request=req), body=None)


def _anthropic_status(status: int, body: object = None) -> anthropic.APIStatusError:
    req = httpx2.Request("POST", "http://x/v1/messages")
    return anthropic.APIStatusError("boom", response=httpx2.Response(status, request=req), body=body)


@pytest.mark.parametrize(("status", "retryable"), [(400, False), (401, False), (408, True), (429, True),
                                                   (500, True), (503, True), (529, True)])
def test_status_errors_are_retryable_for_429_and_5xx(status, retryable):
    for err in (openai_error("m", _openai_status(status)), anthropic_error("c", _anthropic_status(status))):
        assert err.retryable is retryable and err.status == status and f"HTTP {status}" in str(err)


def test_connection_and_mid_stream_errors():
    req = httpx.Request("POST", "http://x")
    assert openai_error("m", openai.APIConnectionError(request=req)).retryable
    assert openai_error("m", openai.APITimeoutError(request=req)).retryable
    assert openai_error("m", openai.APIError("x", req, body={"type": "server_error"})).retryable
    assert not openai_error("m", openai.APIError("x", req, body={"type": "invalid_request_error"})).retryable
    assert anthropic_error("c", httpx2.RemoteProtocolError("peer closed")).retryable
    overloaded = _anthropic_status(200, {"type": "error", "error": {"type": "overloaded_error", "message": "o"}})
    invalid = _anthropic_status(200, {"type": "error", "error": {"type": "invalid_request_error", "message": "i"}})
    assert anthropic_error("c", overloaded).retryable and "overloaded_error" in str(anthropic_error("c", overloaded))
    assert not anthropic_error("c", invalid).retryable
