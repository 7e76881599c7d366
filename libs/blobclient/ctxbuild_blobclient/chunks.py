"""Pure helpers: turn any content (str, bytes, sync/async iterables of either) into byte chunks of bounded size,
and hash a str without holding its UTF-8 copy."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import TypeAlias

Piece: TypeAlias = str | bytes | bytearray | memoryview
Content: TypeAlias = str | bytes | bytearray | Iterable[Piece] | AsyncIterable[Piece]

# chars per encode() slice when streaming a str: ≤ 4 × this many bytes at a time
STR_SLICE = 128 * 1024
# a str up to this many chars is encoded in one go (≤ 16 MiB of UTF-8: one copy, no slicing and re-joining)
WHOLE_STR_MAX = 4 * 1024 * 1024


def _as_bytes(piece: Piece) -> bytes:
    if isinstance(piece, str):
        return piece.encode("utf-8")  # UnicodeEncodeError for a lone surrogate: no UTF-8 form
    if isinstance(piece, (bytes, bytearray, memoryview)):
        return bytes(piece)
    raise TypeError(f"content pieces must be str or bytes, not {type(piece).__name__}")


def str_slices(text: str, slice_chars: int = STR_SLICE) -> Iterator[bytes]:
    """UTF-8 of ``text`` slice by slice (Python str slices never split a code point)."""
    for i in range(0, len(text), slice_chars):
        yield text[i:i + slice_chars].encode("utf-8")


def digest_str(text: str) -> tuple[str, int]:
    """(sha256 hex, UTF-8 size) of a str, encoding it slice by slice."""
    h, n = hashlib.sha256(), 0
    for b in str_slices(text):
        h.update(b)
        n += len(b)
    return h.hexdigest(), n


async def pieces(content: Content) -> AsyncIterator[bytes]:
    """Any supported content as an async stream of non-empty byte pieces (sizes as they come)."""
    if isinstance(content, str):
        if len(content) <= WHOLE_STR_MAX:
            if content:
                yield content.encode("utf-8")
            return
        for b in str_slices(content):
            yield b
        return
    if isinstance(content, (bytes, bytearray, memoryview)):
        if len(content):
            yield bytes(content)
        return
    if hasattr(content, "__aiter__"):
        async for p in content:  # type: ignore[union-attr]
            b = _as_bytes(p)
            if b:
                yield b
        return
    if hasattr(content, "__iter__"):
        for p in content:  # type: ignore[union-attr]
            b = _as_bytes(p)
            if b:
                yield b
        return
    raise TypeError(f"unsupported content type {type(content).__name__}")


class Rechunker:
    """Pull byte pieces of any size and hand out chunks of at most ``n`` bytes (the service's ``max``).
    A large piece is sliced, never copied as a whole or shifted (no quadratic memmove)."""

    def __init__(self, source: AsyncIterator[bytes]) -> None:
        self._source = source
        self._cur = b""
        self._pos = 0
        self._done = False

    async def next(self, n: int) -> bytes:
        """Up to ``n`` bytes; ``b""`` once the source is exhausted."""
        parts: list[bytes] = []
        need = n
        while need > 0:
            if self._pos >= len(self._cur):
                if self._done:
                    break
                try:
                    self._cur, self._pos = await anext(self._source), 0
                except StopAsyncIteration:
                    self._done = True
                    self._cur, self._pos = b"", 0
                    break
            take = self._cur[self._pos:self._pos + need]
            self._pos += len(take)
            need -= len(take)
            parts.append(take)
        return parts[0] if len(parts) == 1 else b"".join(parts)
