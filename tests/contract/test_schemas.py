"""Every JSON Schema in contracts/ is a valid draft 2020-12 schema whose $refs resolve."""

import json
from pathlib import Path

import pytest
from ctxbuild_platform import contracts
from jsonschema import Draft202012Validator

ROOT = contracts.contracts_dir()
SCHEMAS = sorted(p for p in ROOT.rglob("*.json") if "$schema" in json.loads(p.read_text()))


def test_there_are_contracts():
    assert len(SCHEMAS) >= 8


@pytest.mark.parametrize("path", SCHEMAS, ids=lambda p: str(p.relative_to(ROOT)))
def test_schema_is_valid_and_refs_resolve(path: Path):
    doc = json.loads(path.read_text())
    assert doc["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(doc)
    v = contracts.validator(path.relative_to(ROOT).as_posix())
    # resolving every $ref happens lazily; walk them by validating a value that visits all branches shallowly
    list(v.iter_errors({}))


# subjects nobody replies to: a JetStream work-queue command (the stream acks it) and a broadcast notice
NO_REPLY = {"ctx.turn.run", "ctx.turn.abort", "ctx.turn.delta", "ctx.turn.ended", "ctx.turn.appended"}


def test_every_subject_has_request_and_reply():
    subjects = {p.name.rsplit(".", 2)[0] for p in (ROOT / "subjects").glob("*.json")}
    assert subjects >= NO_REPLY
    for s in subjects:
        assert (ROOT / "subjects" / f"{s}.request.json").exists(), s
        assert (ROOT / "subjects" / f"{s}.reply.json").exists() != (s in NO_REPLY), s
