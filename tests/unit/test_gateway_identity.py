"""Implicit conversation identity: the prefix hash chain over the messages as the client sends them."""

from ctxbuild_orchestration.domain.gateway import (
    GatewayResult,
    anthropic_message,
    chain_hash,
    openai_completion,
    parse_anthropic,
    parse_openai,
    prefix_hashes,
    result_message,
    root_hash,
)

SYSTEM = "You are a weather bot."
TOOL = {"name": "get_weather", "description": "w", "input_schema": {"type": "object"}}


def _openai(messages, system=SYSTEM):
    head = [{"role": "system", "content": system}] if system else []
    return parse_openai({"model": "gpt-x", "messages": head + messages})


OPENAI_CONV = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": "{\"city\":\"Paris\",\"unit\":\"C\"}"}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Rome\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "rain"}]},
    {"role": "user", "content": "Thanks. And tomorrow?"},
    {"role": "assistant", "content": "Also sunny."},
    {"role": "user", "content": [{"type": "text", "text": "Great"}, {"type": "text", "text": "!"}]},
]

# the same conversation as an Anthropic client sends it: the tool results and the next question share a user
# message, the system prompt is blocks, input keys in another order, the last question one text block
ANTHROPIC_CONV = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris and Rome?"}]},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"unit": "C", "city": "Paris"}},
        {"type": "tool_use", "id": "call_2", "name": "get_weather", "input": {"city": "Rome"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"},
        {"type": "tool_result", "tool_use_id": "call_2", "content": [{"type": "text", "text": "rain"}]},
        {"type": "text", "text": "Thanks. And tomorrow?"}]},
    {"role": "assistant", "content": "Also sunny."},
    {"role": "user", "content": "Great!"},
]


def _anthropic(messages, system=SYSTEM):
    return parse_anthropic({"model": "claude-x", "max_tokens": 10, "tools": [TOOL],
                            "system": [{"type": "text", "text": system}], "messages": messages})


def test_one_hash_per_message_and_an_extension_keeps_the_prefix():
    full = _openai(OPENAI_CONV)
    hashes = prefix_hashes("t1", full)
    assert len(hashes) == len(full.messages) == 7 and len(set(hashes)) == 7
    for n in range(1, len(OPENAI_CONV)):
        assert prefix_hashes("t1", _openai(OPENAI_CONV[:n])) == hashes[:n]


def test_an_edited_earlier_message_forks_from_there():
    edited = [dict(m) for m in OPENAI_CONV]
    edited[4] = {"role": "user", "content": "Thanks. And next week?"}
    original, forked = prefix_hashes("t1", _openai(OPENAI_CONV)), prefix_hashes("t1", _openai(edited))
    assert forked[:4] == original[:4]
    assert all(a != b for a, b in zip(forked[4:], original[4:], strict=True))
    # a changed tool input or tool output forks as well
    changed_args = [dict(m) for m in OPENAI_CONV[:3]]
    changed_args[1] = {**OPENAI_CONV[1], "tool_calls": [OPENAI_CONV[1]["tool_calls"][0]]}
    assert prefix_hashes("t1", _openai(changed_args))[1] != original[1]
    changed_out = [*OPENAI_CONV[:2], {"role": "tool", "tool_call_id": "call_1", "content": "cloudy"}]
    got = prefix_hashes("t1", _openai(changed_out))
    assert got[:2] == original[:2] and got[2] != original[2]


def test_the_same_conversation_through_either_dialect_hashes_the_same():
    via_openai, via_anthropic = _openai(OPENAI_CONV), _anthropic(ANTHROPIC_CONV)
    great = {"role": "user", "parts": [{"type": "text", "text": "Great"}, {"type": "text", "text": "!"}]}
    assert via_openai.messages == [*via_anthropic.messages[:6], great]  # neutral forms differ in spelling only
    assert prefix_hashes("t1", via_openai) == prefix_hashes("t1", via_anthropic)


def test_tenant_and_system_prompt_separate_the_chains():
    req = _openai(OPENAI_CONV)
    mine, theirs = prefix_hashes("t1", req), prefix_hashes("t2", req)
    assert not set(mine) & set(theirs)
    assert not set(mine) & set(prefix_hashes("t1", _openai(OPENAI_CONV, system="Other.")))
    assert not set(mine) & set(prefix_hashes("t1", _openai(OPENAI_CONV, system=None)))
    assert root_hash("t1", None) == root_hash("t1", "") != root_hash("t1", SYSTEM)


def test_spelling_that_carries_nothing_does_not_change_the_hash():
    a = _openai([{"role": "user", "content": "hi"},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"b\": 1, \"a\": 2}"}}]}])
    b = _openai([{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"a\":2,\"b\":1}"}}]}])
    assert prefix_hashes("t", a) == prefix_hashes("t", b)


def test_a_produced_answer_resent_by_the_client_continues_the_chain_in_both_dialects():
    """The server hashes what it produced with chain_hash(result_message); the client's next request, built
    from the very body the gateway returned, must find it."""
    result = GatewayResult("Checking.", [{"toolCallId": "call_9", "toolName": "get_weather",
                                          "input": {"city": "Oslo"}}], "tool_calls", {})
    first = [{"role": "user", "content": "Oslo?"}]
    stored = prefix_hashes("t", _openai(first))
    produced = chain_hash(stored[-1], result_message(result))

    answer = openai_completion(result, id="x", model="m", created=1)["choices"][0]["message"]
    resent = [*first, {k: v for k, v in answer.items() if v is not None},
              {"role": "tool", "tool_call_id": "call_9", "content": "snow"}]
    assert prefix_hashes("t", _openai(resent))[1] == produced

    message = anthropic_message(result, id="x", model="m")
    resent_a = [{"role": "user", "content": "Oslo?"}, {"role": "assistant", "content": message["content"]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_9", "content": "snow"}]}]
    assert prefix_hashes("t", _anthropic(resent_a)) == prefix_hashes("t", _openai(resent))
