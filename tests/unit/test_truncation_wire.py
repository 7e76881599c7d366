"""The platform's compiled contract check decides exactly as its reference validator (it only answers "valid"
faster), fuzzed over truncation payloads; the service's parse keeps big integers exact; encode falls back to the
stdlib for what orjson refuses."""

from __future__ import annotations

import copy
import json

import pytest
from ctxbuild_platform import contracts
from ctxbuild_platform.errors import InvalidPayload
from ctxbuild_truncation import wire
from hypothesis import given, settings
from hypothesis import strategies as st

REQUEST = "subjects/ctx.truncate.step.request.json"
REPLY = "subjects/ctx.truncate.step.reply.json"
SHA = "0123456789abcdef" * 4
URI = "context://vfs/vfs_0123456789abcdef.txt"

VALID_REQUEST = {
    "conversationId": "c", "turnId": "t", "settings": {"truncateThreshold": 2000, "contextWindow": 1.6e4,
                                                       "reservation": None},
    "parts": [
        {"type": "tool-result", "toolCallId": "a", "toolName": "web_search", "effectiveToolName": "web_search",
         "output": {"type": "json", "value": [{"id": "x-1", "content": "c"}]}},
        {"type": "tool-result", "toolCallId": "b", "toolName": "bash", "output": {"type": "text", "value": ""},
         "offload": {"mode": "offloaded", "uri": URI, "sha256": SHA, "totalChars": 3, "totalLines": 1,
                     "threshold": 2000, "blobs": [{"key": "/0/content", "uri": URI, "sha256": SHA,
                                                   "totalChars": 3, "totalLines": 1}]}},
        {"type": "tool-result", "toolCallId": "c", "toolName": "m", "output": {
            "type": "content", "value": [{"type": "text", "text": "t"}], "metadata": {"k": 1}}},
    ],
    "claims": [{"part": 1, "sha256": SHA, "uri": URI, "size": 3}],
}


def verdict(check, name, payload):
    """None when ``check`` accepts the payload, else its error message."""
    try:
        check(name, payload)
        return None
    except InvalidPayload as exc:
        return exc.message


def decision(name, payload):
    return verdict(contracts.validate_reference, name, payload)


def mine(name, payload):
    return verdict(contracts.validate, name, payload)


JUNK = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=3), st.just([]), st.just({}),
                 st.just("context://vfs/vfs_0123456789abcdef.txt\n"), st.just("0" * 63), st.just(-1))


def paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, (*prefix, i))


ALL_PATHS = [p for p in paths(VALID_REQUEST) if p]


@settings(max_examples=400, deadline=None)
@given(edits=st.lists(st.tuples(st.sampled_from(ALL_PATHS), st.sampled_from(["set", "del", "extra"]), JUNK),
                      max_size=3))
def test_the_compiled_check_decides_as_the_platform(edits):
    payload = copy.deepcopy(VALID_REQUEST)
    for path, op, junk in edits:
        node = payload
        try:
            for k in path[:-1]:
                node = node[k]
            key = path[-1]
            if op == "set":
                node[key] = junk
            elif op == "del" and isinstance(node, dict):
                node.pop(key, None)
            elif op == "extra" and isinstance(node, dict):
                node["zz_extra"] = junk
        except (KeyError, IndexError, TypeError):
            continue
    assert mine(REQUEST, payload) == decision(REQUEST, payload)


def test_valid_payloads_and_the_platforms_leniencies():
    assert mine(REQUEST, VALID_REQUEST) is None
    # Python's `$` matches before a final newline: the platform accepts this URI, so the service does too
    lenient = copy.deepcopy(VALID_REQUEST)
    lenient["claims"][0]["uri"] = URI + "\n"
    assert decision(REQUEST, lenient) is None and mine(REQUEST, lenient) is None
    reply = {"parts": VALID_REQUEST["parts"], "threshold": 2000,
             "trimmed": [{"toolCallId": "a", "mode": "offloaded", "key": "/0/content", "uri": URI, "sha256": SHA,
                          "claim": True, "totalChars": 3, "totalLines": 1}]}
    assert mine(REPLY, reply) is None
    bad = {**reply, "trimmed": [{"toolCallId": "a", "mode": "gone", "totalChars": 3, "totalLines": 1}]}
    assert mine(REPLY, bad) == decision(REPLY, bad) is not None


def test_parse_keeps_big_integers_and_encode_falls_back():
    raw = b'{"n": 123456789012345678901234567890, "f": 1e-7, "s": "\\ud800"}'
    value = wire.parse(raw)
    assert value["n"] == 123456789012345678901234567890 and value["s"] == "\ud800"
    assert json.loads(wire.encode(value)) == value
    assert wire.encode({"a": "é"}) == '{"a":"é"}'.encode()
    with pytest.raises(InvalidPayload):
        wire.parse(b"{nope")
