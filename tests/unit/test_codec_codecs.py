"""SPEC §4: codecs (entities, text-field), JSON-pointer-lite keys, assemble, opaque text extraction, snippet,
and tool policies by effectiveToolName."""

from __future__ import annotations

import json

import orjson
import pytest
from ctxbuild_codec import (
    CODECS,
    Blob,
    assemble,
    compact_json,
    deflate,
    effective_tool_name,
    extract_text,
    inflate_value,
    pointer,
    policy_for,
    snippet,
    split_key,
)
from ctxbuild_codec.codecs import get_at

RESULTS = [
    {"id": "k3Jd9xQa-1", "title": "Mesko", "url": "https://telesystem.eu/en/", "content": "Products\nGROM"},
    {"id": "k3Jd9xQa-2", "url": "https://example.org/b", "content": "b" * 10, "title": "B", "extra": {"n": 1}},
]


# ---------- entities ----------

def test_entities_deflate_one_blob_per_item_skeleton_is_the_value():
    d = deflate("entities", RESULTS)
    assert d.skeleton is RESULTS
    assert d.blobs == [Blob("/0/content", "Products\nGROM"), Blob("/1/content", "b" * 10)]


@pytest.mark.parametrize("value", [
    [], {}, "text", None, 3,
    [{"id": 1, "content": "x"}, "not an object"],
    [{"id": 1, "content": "x"}, {"id": 2}],               # content missing
    [{"id": 1, "content": ["x"]}],                         # content not a string
    [{"id": 1, "content": None}],
])
def test_entities_deflate_rejects_other_shapes(value):
    assert deflate("entities", value) is None


def test_text_field_deflate():
    page = {"kind": "text", "text": "     1\tline", "startLine": 1, "endLine": 1, "totalLines": 1}
    d = deflate("text-field", page)
    assert d.skeleton is page and d.blobs == [Blob("/text", "     1\tline")]
    for bad in ([page], {"text": 3}, {"kind": "error", "message": "x"}, "text"):
        assert deflate("text-field", bad) is None


def test_codec_registry_names():
    assert sorted(CODECS) == ["entities", "text-field"]


# ---------- keys ----------

def test_pointer_lite_keys():
    assert pointer() == ""
    assert pointer(3, "content") == "/3/content"
    assert pointer("text") == "/text"
    assert pointer("a/b", "c~d") == "/a~1b/c~0d"
    assert split_key("/a~1b/c~0d") == ["a/b", "c~d"]
    assert split_key("") == []
    with pytest.raises(ValueError):
        split_key("3/content")
    assert get_at(RESULTS, "/1/title") == "B"
    with pytest.raises(KeyError):
        get_at(RESULTS, "/7/title")


# ---------- assemble ----------

def test_assemble_replaces_only_the_keys_and_keeps_key_order_bytes():
    out = assemble(RESULTS, {"/1/content": "MARKER"})
    assert json.dumps(out) == json.dumps(RESULTS).replace('"' + "b" * 10 + '"', '"MARKER"')
    assert list(out[1]) == ["id", "url", "content", "title", "extra"]  # insertion order kept
    assert out[0] is RESULTS[0] and out[1]["extra"] is RESULTS[1]["extra"]  # untouched branches shared
    assert RESULTS[1]["content"] == "b" * 10  # the skeleton is never mutated


def test_assemble_unchanged_or_missing_key_returns_the_same_object():
    assert assemble(RESULTS, {}) is RESULTS
    assert assemble(RESULTS, {"/0/content": "Products\nGROM"}) is RESULTS  # equal value: nothing changes
    assert assemble(RESULTS, {"/9/content": "x", "/0/nope": "x", "/01/content": "x"}) is RESULTS
    page = {"text": "t", "n": 1}
    assert assemble(page, {"/text": "t"}) is page
    assert assemble(page, {"/missing": "t"}) is page


def test_assemble_whole_value_and_nested_paths():
    assert assemble({"a": 1}, {"": "whole"}) == "whole"
    nested = {"hits": [{"doc": {"body": "long", "id": 1}}], "q": "x"}
    out = assemble(nested, {"/hits/0/doc/body": "short"})
    assert out == {"hits": [{"doc": {"body": "short", "id": 1}}], "q": "x"}
    assert nested["hits"][0]["doc"]["body"] == "long"
    # a key under another key that is replaced whole is moot, whatever the order
    assert assemble(nested, {"/hits/0/doc/body": "s", "/hits/0": "W"})["hits"] == ["W"]
    assert assemble(nested, {"/hits/0": "W", "/hits/0/doc/body": "s"})["hits"] == ["W"]
    # the fast path for entities and the generic path agree (mixed keys force the generic one)
    items = [{"content": "a", "t": 1}, {"content": "b", "t": 2}]
    fast = assemble(items, {"/0/content": "A", "/1/content": "B"})
    generic = assemble(items, {"/0/content": "A", "/1/content": "B", "/1/t/x": "ignored"})
    assert fast == generic == [{"content": "A", "t": 1}, {"content": "B", "t": 2}]


def test_inflate_of_deflate_is_identity_byte_for_byte():
    for codec, value in (("entities", RESULTS), ("text-field", {"kind": "text", "text": "é\n" * 9, "x": [1]})):
        d = deflate(codec, value)
        back = inflate_value(d.skeleton, d.blobs)
        assert orjson.dumps(back) == orjson.dumps(value)
        assert inflate_value(d.skeleton, {b.key: b.text for b in d.blobs}) == value


# ---------- opaque lane text ----------

def test_extract_text_per_output_type():
    assert extract_text({"type": "text", "value": "a\nb"}) == "a\nb"
    assert extract_text({"type": "error-text", "value": "boom"}) == "boom"
    assert extract_text({"type": "json", "value": {"k": "é", "n": [1, 2]}}) == '{"k":"é","n":[1,2]}'
    assert extract_text({"type": "error-json", "value": ["x"]}) == '["x"]'
    content = {"type": "content", "value": [
        {"type": "text", "text": "first"}, {"type": "image", "data": "AAAA", "mimeType": "image/png"},
        {"type": "text", "text": ""}, {"type": "text", "text": "second"}]}
    assert extract_text(content) == "first\nsecond"
    assert extract_text({"type": "content", "value": []}) == ""
    assert extract_text({"type": "persisted", "value": {}}) is None
    assert extract_text({"type": "something-else", "value": "x"}) is None


def test_compact_json():
    assert compact_json({"a": [1, {"b": None}], "é": "ü"}) == '{"a":[1,{"b":null}],"é":"ü"}'


def test_snippet():
    assert snippet("  short \n") == "short"
    assert snippet("x" * 300) == "x" * 300
    assert snippet(" " + "y" * 301 + " ") == "y" * 300 + "…"


# ---------- policies ----------

def test_policy_table():
    for name in ("web_search", "web_fetch"):
        assert policy_for(name) == policy_for({"toolName": name})
        p = policy_for(name)
        assert (p.codec, p.truncatable, p.defer) == ("entities", True, "auto")
    p = policy_for("kb_search")
    assert (p.codec, p.truncatable, p.defer) == ("entities", True, "never")
    p = policy_for("fs_read")
    assert (p.codec, p.truncatable, p.defer) == ("text-field", False, "never")  # in-flight exemption
    p = policy_for("read_file")
    assert (p.codec, p.truncatable, p.defer) == ("text-field", True, "never")
    p = policy_for("some_builtin")
    assert (p.codec, p.truncatable, p.defer) == (None, True, "never")


def test_mcp_tools_defer_auto_unless_approval_gated():
    name = "mcp__github__search_issues_0123456789abcdef0123"
    assert policy_for(name).defer == "auto"
    assert policy_for(name, approval_gated=True).defer == "never"
    assert policy_for(name).codec is None and policy_for(name).truncatable


def test_policy_is_looked_up_by_effective_tool_name():
    inner = {"toolName": "tool_invoke", "effectiveToolName": "fs_read"}
    assert effective_tool_name(inner) == "fs_read" and policy_for(inner).truncatable is False
    # the outer name never shields a truncatable inner tool
    outer = {"toolName": "fs_read", "effectiveToolName": "mcp__srv__dump"}
    assert policy_for(outer).truncatable is True and policy_for(outer).defer == "auto"
    # a web tool run through tool_invoke gets its codec
    assert policy_for({"toolName": "tool_invoke", "effectiveToolName": "web_fetch"}).codec == "entities"
    assert effective_tool_name({"toolName": "web_fetch"}) == "web_fetch"
    assert effective_tool_name({}) == ""
