"""Text that can be stored and read back: UTF-8 has no lone surrogates (a JSON ``\\ud800`` escape decodes to
one), and Postgres ``text`` columns hold no NUL. One walker for the three places that care: the edge refuses such
input, persistence refuses events no reader could get back, the runner repairs tool outputs where they enter a
turn."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # a valid pair is one code point once decoded
NUL_OR_SURROGATE = re.compile("[\x00\ud800-\udfff]")


@dataclass(frozen=True)
class BadText:
    path: str  # where the string is (``body.settings.title``, ``data.a[1]``)
    char: str  # the offending character
    index: int | None  # its index in the string; None when it is in a key

    @property
    def in_key(self) -> bool:
        return self.index is None

    def describe(self) -> str:
        return "a NUL character" if self.char == "\x00" else f"a lone surrogate (U+{ord(self.char):04X})"


def first_bad_text(value: Any, where: str, pattern: re.Pattern[str] = NUL_OR_SURROGATE) -> BadText | None:
    """The first string of a JSON value (keys included, depth first) holding a character of ``pattern``."""
    if isinstance(value, str):
        m = pattern.search(value)
        return BadText(where, m.group(), m.start()) if m is not None else None
    if isinstance(value, Mapping):
        for k, v in value.items():
            if isinstance(k, str) and (m := pattern.search(k)) is not None:
                return BadText(where, m.group(), None)
            if (found := first_bad_text(v, f"{where}.{k}", pattern)) is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if (found := first_bad_text(v, f"{where}[{i}]", pattern)) is not None:
                return found
    return None


def storable(value: Any) -> Any:
    """``value`` with every lone surrogate replaced by U+FFFD (keys too, at any depth); a split pair rejoins."""
    if isinstance(value, str):
        if LONE_SURROGATE.search(value) is None:
            return value
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [storable(v) for v in value]
    return value
