"""contracts/envelopes/: the v1 and v2 persisted-output envelopes (SPEC §7) as JSON Schemas, the generated
models, and the envelopes the persist lane writes. Stored envelopes must keep validating forever: the literal
envelopes below are what ctxbuild has written; change them only by adding new ones."""

from __future__ import annotations

import json

import pytest
from ctxbuild_codec import trim_persist
from ctxbuild_codec.envelopes import EnvelopeError, PersistedOutputV1, PersistedOutputV2, parse
from ctxbuild_platform import contracts
from ctxbuild_platform.errors import InvalidPayload
from jsonschema import Draft202012Validator

SHA = "da8ec8a5d8b75edcdfe7c8c69b2990685a5c4ff0c371e618d27088be83dd9187"
V1_TEXT = {"fileEntryId": SHA, "vfsFilename": "vfs_da8ec8a5d8b75edc.txt", "head": "line 0001\n",
           "tail": "line 0300\n", "totalChars": 3000, "totalLines": 301, "shape": "text"}
V1_MCP = {**V1_TEXT, "shape": "mcp-content", "metadata": {"server": "github"},
          "blocks": [{"type": "text", "text": 1200}, {"type": "image", "data": "QUJD", "mimeType": "image/png"},
                     {"type": "text", "text": 1799}]}
V2 = {"shape": "entities",
      "skeleton": [{"id": "Xa8d0kLm-1", "title": "A", "url": "https://a.example/1", "content": "line 0001…"}],
      "blobRefs": [{"key": "/0/content", "fileEntryId": SHA, "vfsFilename": "vfs_da8ec8a5d8b75edc.txt",
                    "head": "line 0001\n", "tail": "line 0300\n", "totalChars": 3000, "totalLines": 301}]}
STORED = {"v1-text": V1_TEXT, "v1-mcp-content": V1_MCP, "v2-entities": V2}


def test_schemas_are_draft_2020_12():
    root = contracts.contracts_dir() / "envelopes"
    names = sorted(p.name for p in root.glob("*.json"))
    assert names == ["envelope.json", "v1.json", "v2.json"]
    for name in names:
        doc = json.loads((root / name).read_text())
        assert doc["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        Draft202012Validator.check_schema(doc)


@pytest.mark.parametrize("name", sorted(STORED))
def test_stored_envelopes_keep_validating(name):
    env = STORED[name]
    contracts.validate("envelopes/envelope.json", env)
    contracts.validate(f"envelopes/{'v2' if name.startswith('v2') else 'v1'}.json", env)
    model = parse(env)
    assert isinstance(model, PersistedOutputV2 if name.startswith("v2") else PersistedOutputV1)
    assert model.model_dump(mode="json", exclude_unset=True) == env


@pytest.mark.parametrize("bad", [
    {**V1_TEXT, "shape": "json"},
    {**V1_TEXT, "fileEntryId": "DA8E"},
    {**V1_TEXT, "totalLines": 0},
    {**V1_TEXT, "unknown": 1},
    {k: v for k, v in V1_TEXT.items() if k != "head"},
    {**V2, "blobRefs": []},
    {**V2, "blobRefs": [{**V2["blobRefs"][0], "key": "0/content"}]},
    {**V2, "shape": "text"},
])
def test_invalid_envelopes_are_rejected_by_schema_and_models(bad):
    with pytest.raises(InvalidPayload):
        contracts.validate("envelopes/envelope.json", bad)
    with pytest.raises(EnvelopeError):
        parse(bad)


def test_what_the_persist_lane_writes_validates():
    lines = "".join(f"line {i:04d}\n" for i in range(1, 301))
    def store(b):
        return b.uri
    outputs = [
        ("mcp__x__y_0", {"type": "text", "value": lines}),
        ("mcp__x__y_0", {"type": "content", "value": [{"type": "text", "text": lines}], "metadata": {"a": 1}}),
        ("mcp__x__y_0", {"type": "content", "value": [{"type": "text", "text": lines},
                                                      {"type": "image", "data": "QUJD", "mimeType": "image/png"}]}),
        ("web_fetch", {"type": "json", "value": [{"id": "a-1", "url": "u", "title": "t", "content": lines}]}),
        ("fs_read", {"type": "json", "value": {"kind": "text", "text": lines, "startLine": 1}}),
    ]
    for name, output in outputs:
        part = {"type": "tool-result", "toolCallId": "c", "toolName": name, "output": output}
        stored = trim_persist(part, 2_000, store)
        assert stored["output"]["type"] == "persisted", name
        contracts.validate("model/part.json", stored)
        contracts.validate("envelopes/envelope.json", stored["output"]["value"])
        parse(stored["output"]["value"])
