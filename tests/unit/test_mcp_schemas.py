"""Wire-schema sanitizers per dialect (SPEC §11, finding #1): open objects, $ref/$defs, drafts, strict mode,
Gemini's subset, examples validated against the FINAL wire schema, arguments taken back from the wire."""

from __future__ import annotations

import copy

import pytest
from ctxbuild_mcp_catalog.domain import meta, schemas
from ctxbuild_mcp_catalog.domain.schemas import DIALECTS, check_examples, check_wire, wire_tool
from jsonschema import Draft202012Validator

OPEN = {"type": "object", "properties": {"name": {"type": "string"},
                                         "params": {"type": "object", "additionalProperties": True}},
        "required": ["name", "params"], "additionalProperties": False}


def closing_sanitizer(schema):
    """The reference's bug: close every object (additionalProperties: false), explicit true included."""
    def fn(node):
        if node.get("type") == "object":
            node["additionalProperties"] = False
        return node
    return schemas.map_schema(copy.deepcopy(schema), fn)


# ---------- finding #1 ----------
def test_finding_1_tool_invoke_example_with_params_is_valid_on_the_anthropic_wire():
    deferred = [{"id": "mcp__time__get_current_time_8b5af4dc05e3a09e2e3c", "name": "get_current_time",
                 "serverId": "time", "namespace": "time", "description": "Get current time",
                 "inputSchema": {"type": "object", "properties": {"timezone": {"type": "string"}},
                                 "required": ["timezone"]}}]
    invoke = next(m for m in meta.definitions(deferred) if m["name"] == "tool_invoke")
    example = invoke["inputExamples"][0]
    assert example["params"] == {"timezone": "<timezone>"}  # the example really carries params
    wire, report = wire_tool(invoke["name"], invoke["description"], invoke["inputSchema"], "anthropic",
                             invoke["inputExamples"])
    assert wire["inputSchema"]["properties"]["params"]["additionalProperties"] is True  # explicit true survives
    assert wire["inputExamples"] == [example] and report.examples_dropped == 0
    assert Draft202012Validator(wire["inputSchema"]).is_valid(example)
    assert check_examples(wire, "anthropic") == 0 and check_wire(wire["inputSchema"], "anthropic") == []
    # the reference's closing sanitizer made the same example invalid (→ HTTP 400 "Example at index 0 is
    # invalid"); our final validation would drop it instead of sending it
    closed = closing_sanitizer(invoke["inputSchema"])
    assert not Draft202012Validator(closed).is_valid(example)
    assert not schemas.is_valid(closed, example)


def test_an_example_invalid_against_the_final_wire_schema_is_dropped_never_sent():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "examples": [1, "two", 3],
                                                     "default": "x"}}}
    for dialect in ("anthropic", "openai"):
        wire, report = wire_tool("t", "", schema, dialect, [{"n": 1}, {"n": "bad"}])
        n = wire["inputSchema"]["properties"]["n"]
        assert n["examples"] == [1, 3] and "default" not in n
        assert report.defaults_dropped == 1
        assert check_examples(wire, dialect) == 0
        if dialect == "anthropic":
            assert wire["inputExamples"] == [{"n": 1}]
        else:
            assert "inputExamples" not in wire  # OpenAI has no such field: not sent


# ---------- open objects, refs, drafts ----------
def test_open_objects_survive_on_anthropic_and_openai():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "additionalProperties": True},
        "b": {"type": "object", "additionalProperties": {}},
        "c": {"type": "object", "properties": {"x": {"type": "string"}}}}}
    for dialect in ("anthropic", "openai"):
        wire = wire_tool("t", "", schema, dialect)[0]["inputSchema"]
        assert schemas.count_open_objects(wire) == 2
        assert "additionalProperties" not in wire["properties"]["c"]  # we never close an object


def test_refs_and_defs_stay_resolvable_and_dangling_refs_go():
    schema = {"type": "object", "$defs": {"p": {"type": "object", "properties": {"id": {"type": "string"}},
                                                 "additionalProperties": True}},
              "properties": {"parent": {"$ref": "#/$defs/p"}, "ghost": {"$ref": "#/$defs/nope"}}}
    wire = wire_tool("t", "", schema, "anthropic")[0]["inputSchema"]
    assert wire["properties"]["parent"] == {"$ref": "#/$defs/p"}
    assert "$ref" not in wire["properties"]["ghost"]
    assert check_wire(wire, "anthropic") == []
    gem = wire_tool("t", "", schema, "gemini")[0]["inputSchema"]
    assert gem["properties"]["parent"]["properties"]["id"] == {"type": "string"}  # inlined
    assert check_wire(gem, "gemini") == []


def test_draft_07_is_rewritten_to_2020_12():
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
              "definitions": {"s": {"type": "string"}},
              "properties": {"a": {"$ref": "#/definitions/s", "minLength": 3},
                             "t": {"type": "array", "items": [{"type": "string"}, {"type": "integer"}],
                                   "additionalItems": False},
                             "n": {"type": "number", "minimum": 0, "exclusiveMinimum": True}}}
    wire = wire_tool("t", "", schema, "anthropic")[0]["inputSchema"]
    assert "$schema" not in wire and "definitions" not in wire and wire["$defs"] == {"s": {"type": "string"}}
    assert wire["properties"]["a"] == {"$ref": "#/$defs/s"}  # draft-07 ignores $ref siblings
    assert wire["properties"]["t"]["prefixItems"] == [{"type": "string"}, {"type": "integer"}]
    assert wire["properties"]["t"]["items"] is False
    assert wire["properties"]["n"] == {"type": "number", "exclusiveMinimum": 0}
    assert check_wire(wire, "anthropic") == []


def test_a_root_combinator_is_merged_into_one_object_that_accepts_every_original_input():
    schema = {"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
                         "additionalProperties": False},
                        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"],
                         "additionalProperties": False}]}
    for dialect in ("anthropic", "openai", "gemini"):
        wire = wire_tool("t", "", schema, dialect)[0]["inputSchema"]
        assert "oneOf" not in wire and wire["type"] == "object"
        assert set(wire["properties"]) == {"a", "b"} and not wire.get("required")
        assert check_wire(wire, dialect) == []
    anth = wire_tool("t", "", schema, "anthropic")[0]["inputSchema"]
    for ok in ({"a": "x"}, {"b": 1}):
        assert schemas.is_valid(anth, ok)


def test_openai_arrays_get_items():
    schema = {"type": "object", "properties": {"xs": {"type": "array"}}}
    assert wire_tool("t", "", schema, "openai")[0]["inputSchema"]["properties"]["xs"]["items"] == {}
    assert check_wire(schema, "openai") == ["/properties/xs: array schema missing items"]


# ---------- OpenAI strict ----------
def test_strict_closes_objects_and_makes_optional_properties_nullable():
    schema = {"type": "object", "properties": {
        "q": {"type": "string", "minLength": 1},
        "n": {"type": "integer", "default": 3},
        "mode": {"type": "string", "enum": ["a", "b"]},
        "sub": {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]}},
        "required": ["q"]}
    wire = wire_tool("t", "", schema, "openai-strict")[0]
    s = wire["inputSchema"]
    assert wire["strict"] is True
    assert s["additionalProperties"] is False and s["required"] == ["q", "n", "mode", "sub"]
    assert s["properties"]["q"] == {"type": "string"}  # minLength is not supported in strict mode
    assert s["properties"]["n"] == {"type": ["integer", "null"]}
    assert s["properties"]["mode"] == {"type": ["string", "null"], "enum": ["a", "b", None]}
    assert s["properties"]["sub"]["type"] == ["object", "null"]
    assert s["properties"]["sub"]["additionalProperties"] is False
    assert check_wire(s, "openai-strict", True) == []


@pytest.mark.parametrize("prop", [
    {"type": "object", "additionalProperties": True},
    {"type": "object"},  # no properties: an open bag
    {"type": "object", "additionalProperties": {"type": "string"}},  # a typed map
    {},  # any value
    {"type": "array"},
])
def test_a_schema_that_cannot_be_strict_is_sent_non_strict_intact(prop):
    schema = {"type": "object", "properties": {"p": prop}}
    wire, report = wire_tool("t", "", schema, "openai-strict")
    assert wire["strict"] is False and report.not_strict_reason
    assert check_wire(wire["inputSchema"], "openai-strict", False) == []
    if prop.get("additionalProperties") is True:
        assert wire["inputSchema"]["properties"]["p"]["additionalProperties"] is True


# ---------- Gemini ----------
def test_gemini_subset():
    schema = {"type": "object", "properties": {
        "link": {"type": ["object", "null"]},
        "kind": {"const": "page"},
        "n": {"type": "integer", "enum": [1, 2], "format": "int32"},
        "id": {"type": "string", "format": "uuid"},
        "flag": {"type": ["boolean", "string"]},
        "meta": {"type": "object", "additionalProperties": True},
        "opt": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "deep": {"type": "object", "properties": {"x": {"type": "number", "exclusiveMinimum": 0}},
                 "additionalProperties": True}},
        "required": ["kind"]}
    wire = wire_tool("t", "", schema, "gemini")[0]["inputSchema"]
    p = wire["properties"]
    assert p["link"]["type"] == "string" and p["link"]["nullable"] is True  # open object → JSON string
    assert p["kind"] == {"type": "string", "enum": ["page"]}
    assert p["n"]["type"] == "integer" and "enum" not in p["n"] and p["n"]["format"] == "int32"
    assert "allowed values: 1, 2" in p["n"]["description"]
    assert p["id"] == {"type": "string", "description": "(format: uuid)"}
    assert [b["type"] for b in p["flag"]["anyOf"]] == ["boolean", "string"]
    assert p["meta"]["type"] == "string"
    assert p["opt"] == {"type": "string", "nullable": True}
    assert p["deep"]["properties"]["x"] == {"type": "number", "minimum": 0}
    assert check_wire(wire, "gemini") == []
    assert wire_tool("t", "", {"type": "object", "properties": {}}, "gemini")[0]["inputSchema"] is None


# ---------- arguments back from the wire ----------
def test_coerce_arguments_undoes_the_dialects_and_nothing_else():
    schema = {"type": "object", "properties": {
        "meta": {"type": "object", "additionalProperties": True},
        "tags": {"type": "array", "items": {"type": "string"}},
        "note": {"type": "string"},
        "n": {"type": "integer"},
        "maybe": {"type": ["string", "null"]}},
        "required": ["note"]}
    args = {"meta": '{"a": 1}', "tags": '["x"]', "note": '{"keep": "me"}', "n": None, "maybe": None}
    assert schemas.coerce_arguments(schema, args) == {"meta": {"a": 1}, "tags": ["x"], "note": '{"keep": "me"}',
                                                      "maybe": None}
    assert schemas.coerce_arguments(schema, {"meta": "not json"}) == {"meta": "not json"}  # server decides
    assert schemas.coerce_arguments(meta.INVOKE_SCHEMA, {"name": "x", "params": '{"tz": "UTC"}'}) == \
        {"name": "x", "params": {"tz": "UTC"}}


def test_every_dialect_handles_the_meta_tools():
    deferred = [{"id": "mcp__s__t_" + "0" * 20, "name": "t", "serverId": "s", "namespace": "s",
                 "description": "", "inputSchema": {"type": "object", "properties": {"q": {"type": "string"}},
                                                    "required": ["q"]}}]
    for m in meta.definitions(deferred):
        for dialect in DIALECTS:
            wire, _ = wire_tool(m["name"], m["description"], m["inputSchema"], dialect, m["inputExamples"])
            assert check_wire(wire["inputSchema"], dialect, wire.get("strict")) == [], (m["name"], dialect)
            assert check_examples(wire, dialect) == 0
