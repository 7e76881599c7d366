"""The wire format of ``ctx.truncate.step``: parse and encode (contract checks: ``ctxbuild_platform.contracts``,
whose compiled fast path took ~0.9 ms off every 50 KB step).

- Parsing uses the stdlib (orjson turns integers beyond 64 bits into floats: a tool's JSON must come back
  exactly); encoding uses orjson (compact UTF-8), the stdlib for what orjson refuses (big integers, lone
  surrogates).
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from ctxbuild_platform.rpc import decode_request


def parse(raw: bytes) -> Any:
    """The request's JSON; hostile input (deep nesting, lone surrogates, integers past 64 bits) is
    ``invalid-payload`` like on every @rpc subject, never a crash reply."""
    return decode_request(raw)


def encode(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, separators=(",", ":")).encode()
