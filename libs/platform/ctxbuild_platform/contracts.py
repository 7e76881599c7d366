"""JSON Schema contracts from the repository's `contracts/` folder (draft 2020-12).

Schemas are addressed by their path under contracts/, e.g. ``subjects/ctx.blob.put.request.json``;
``$ref`` between them is relative. Validation errors become :class:`InvalidPayload` with the JSON path.
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema_rs
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from .errors import InvalidPayload

BASE_URI = "https://ctxbuild.dev/contracts/"


def contracts_dir() -> Path:
    env = os.environ.get("CTX_CONTRACTS_DIR")
    if env:
        return Path(env)
    for parent in Path(__file__).resolve().parents:
        candidate = parent / "contracts"
        if (candidate / "subjects").is_dir():
            return candidate
    raise FileNotFoundError("contracts/ not found: set CTX_CONTRACTS_DIR")


@cache
def _registry() -> tuple[Registry, dict[str, dict]]:
    root = contracts_dir()
    schemas: dict[str, dict] = {}
    resources = []
    for path in sorted(root.rglob("*.json")):
        rel = path.relative_to(root).as_posix()
        doc = json.loads(path.read_text())
        if "$schema" not in doc:
            continue  # generated documents (asyncapi/openapi) are not schemas
        uri = BASE_URI + rel
        schemas[rel] = doc
        resources.append((uri, Resource.from_contents(doc)))
    return Registry().with_resources(resources), schemas


@cache
def validator(name: str) -> Draft202012Validator:
    registry, schemas = _registry()
    if name not in schemas:
        raise KeyError(f"no contract {name!r} under {contracts_dir()}")
    schema = {"$ref": BASE_URI + name}
    return Draft202012Validator(schema, registry=registry, format_checker=Draft202012Validator.FORMAT_CHECKER)


@cache
def _compiled(name: str) -> jsonschema_rs.Draft202012Validator:
    """The same schema compiled by jsonschema-rs (the fast path: bench/results hold the figures)."""
    _, schemas = _registry()
    if name not in schemas:
        raise KeyError(f"no contract {name!r} under {contracts_dir()}")
    resources = [(BASE_URI + rel, doc) for rel, doc in schemas.items()]
    return jsonschema_rs.Draft202012Validator({"$ref": BASE_URI + name},
                                              registry=jsonschema_rs.Registry(resources), validate_formats=True)


def reset_cache() -> None:
    """Forget loaded schemas (tests that point CTX_CONTRACTS_DIR elsewhere)."""
    for f in (_registry, validator, _compiled):
        f.cache_clear()


def has_contract(name: str) -> bool:
    return name in _registry()[1]


def validate(name: str, payload: Any) -> None:
    """Raise InvalidPayload exactly when `validate_reference` does. The compiled validator (at least as strict:
    formats and patterns included) answers "valid" fast; anything it rejects goes to the reference validator,
    which decides and words the error."""
    if not _compiled(name).is_valid(payload):
        validate_reference(name, payload)


def validate_reference(name: str, payload: Any) -> None:
    """The authority (python-jsonschema): InvalidPayload naming the deepest, most relevant violation."""
    v = validator(name)
    errors = sorted(v.iter_errors(payload), key=lambda e: (len(e.absolute_path), e.path), reverse=True)
    if errors:
        e = errors[0]
        where = "/" + "/".join(str(p) for p in e.absolute_path)
        raise InvalidPayload(f"{name} at {where}: {e.message[:300]}",
                             details={"contract": name, "path": where, "violations": len(errors)})


# subjects with a per-entity last token (one subject per turn): one contract for the family
SUBJECT_FAMILIES = ("ctx.turn.delta", "ctx.turn.ended", "ctx.turn.appended")


def subject_contract(subject: str, kind: str) -> str:
    """Contract file for a subject's `request`, `reply` or `event` payload."""
    for family in SUBJECT_FAMILIES:
        if subject.startswith(family + "."):
            subject = family
    return f"subjects/{subject}.{kind}.json"
