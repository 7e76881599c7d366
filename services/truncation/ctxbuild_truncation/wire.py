"""The wire format of ``ctx.truncate.step``: parse and encode (contract checks: ``ctxbuild_platform.contracts``).

- Parsing uses the stdlib (orjson turns integers beyond 64 bits into floats: a tool's JSON must come back
  exactly); encoding uses orjson (compact UTF-8), the stdlib for what orjson refuses (big integers, lone
  surrogates).
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from ctxbuild_platform.errors import InvalidPayload


def parse(raw: bytes) -> Any:
    """The request's JSON. Tool outputs keep what they hold (big integers, lone surrogates: trimmed as they came),
    but nesting too deep to decode is ``invalid-payload``, never a crash reply."""
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidPayload(f"payload is not JSON: {exc}") from exc
    except RecursionError as exc:
        raise InvalidPayload("payload nests too deeply to decode") from exc


def encode(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, separators=(",", ":")).encode()
