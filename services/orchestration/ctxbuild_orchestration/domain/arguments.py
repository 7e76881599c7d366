"""Tool arguments are data, never identity (SPEC §6): a model's arguments to a built-in, web or meta tool are
checked against the tool's schema before anything runs. Unknown keys are refused even where a schema leaves the
object open, so a smuggled ``conversationId``/``turnId``/``owner`` can never reach a request; the server sets
identity itself, after the arguments. A refusal is the tool's output (the model reads it, the turn goes on)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from jsonschema import Draft202012Validator

MAX_MESSAGE_CHARS = 300


@lru_cache(maxsize=64)
def _validator(schema_json: str) -> Draft202012Validator:
    return Draft202012Validator(json.loads(schema_json))


def argument_error(tool: str, schema: Mapping[str, Any], args: Any) -> str | None:
    """Why ``args`` are not valid input for ``tool`` (one clear sentence), or None when they are."""
    if not isinstance(args, Mapping):
        return f"{tool}: the arguments must be a JSON object"
    allowed = sorted((schema.get("properties") or {}).keys())
    unknown = sorted(k for k in args if k not in allowed)
    if unknown:
        return f"{tool}: unknown argument(s) {unknown}; allowed: {allowed}"
    errors = sorted(_validator(json.dumps(schema, sort_keys=True)).iter_errors(dict(args)),
                    key=lambda e: [str(p) for p in e.absolute_path])
    if not errors:
        return None
    first = errors[0]
    where = "/".join(str(p) for p in first.absolute_path) or "arguments"
    return f"{tool}: {where}: {first.message}"[:MAX_MESSAGE_CHARS]


def invalid_arguments_output(message: str) -> dict[str, Any]:
    return {"type": "error-text", "value": f"[Error: invalid-arguments] {message}"}
