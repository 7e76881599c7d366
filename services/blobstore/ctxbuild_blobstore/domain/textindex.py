"""One streaming pass over a blob's bytes: size, text-or-binary, chars, lines, and a sparse seek index.

The index is what lets fs_read and read_file serve a page of a 100 MB blob by reading a few hundred KB:
- line marks ``(line number, byte offset of that line's start)``;
- char marks ``(char offset, byte offset)`` at character boundaries.
Marks are taken every ``stride`` bytes (one per window) and thinned (every other one dropped, spacing doubled)
whenever there are more than ``max_marks``, so the index stays small for any size, and it is computed in the same
pass that hashes the upload: bounded memory, no second read.

Text rules are the blob store's (``binary.py``): a NUL in the first 8 KB, or bytes that are not UTF-8, make the
blob binary (fs_read/read_file refuse it). Lines follow fs_read: split on ``\\n``, one trailing empty piece dropped.
"""

from __future__ import annotations

import codecs
from array import array
from bisect import bisect_right
from dataclasses import dataclass, field

from .binary import SNIFF_BYTES

DEFAULT_STRIDE = 64 * 1024
DEFAULT_MAX_MARKS = 4096


@dataclass(frozen=True, slots=True)
class Marks:
    """Sorted seek points: ``keys[i]`` (a line number or a char offset) starts at byte ``offsets[i]``."""

    keys: array = field(default_factory=lambda: array("q"))
    offsets: array = field(default_factory=lambda: array("q"))

    def floor(self, key: int) -> tuple[int, int]:
        """The last mark with ``mark ≤ key`` as ``(mark, byte offset)``."""
        i = bisect_right(self.keys, key) - 1
        return (self.keys[i], self.offsets[i]) if i >= 0 else (self.keys[0], self.offsets[0])

    def ceil_offset(self, key: int) -> int | None:
        """Byte offset of the first mark with ``mark ≥ key`` (None: no such mark)."""
        i = bisect_right(self.keys, key - 1)
        return self.offsets[i] if i < len(self.keys) else None

    def __len__(self) -> int:
        return len(self.keys)


def origin_marks(first_key: int) -> Marks:
    return Marks(array("q", [first_key]), array("q", [0]))


@dataclass(frozen=True, slots=True)
class TextIndex:
    size: int
    is_text: bool
    chars: int | None  # None for binary content
    lines: int | None
    line_marks: Marks
    char_marks: Marks

    @property
    def trivial(self) -> bool:
        """Only the origin marks: nothing worth storing (the reader starts at byte 0 anyway)."""
        return len(self.line_marks) <= 1 and len(self.char_marks) <= 1


class Indexer:
    """Feed the bytes in order (any piece sizes), then :meth:`finish`."""

    def __init__(self, stride: int = DEFAULT_STRIDE, max_marks: int = DEFAULT_MAX_MARKS) -> None:
        if stride < 16 or max_marks < 2:
            raise ValueError("stride ≥ 16 and max_marks ≥ 2")
        self.stride = stride
        self.max_marks = max_marks
        self._every = 1  # take a mark every n windows (doubles when thinning)
        self._window_no = 0
        self._pending = bytearray()
        self._pos = 0  # bytes processed (window starts)
        self._decoder = codecs.getincrementaldecoder("utf-8")("strict")
        self._is_text = True
        self._chars = 0
        self._newlines = 0
        self._line_start = 0  # byte offset where the current (unfinished) line starts
        self._last_byte = -1
        self._line_keys, self._line_offs = array("q", [1]), array("q", [0])
        self._char_keys, self._char_offs = array("q", [0]), array("q", [0])

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        if self._pending:
            need = self.stride - len(self._pending)
            self._pending += view[:need]
            view = view[need:]
            if len(self._pending) < self.stride:
                return
            self._window(bytes(self._pending))
            self._pending.clear()
        n = len(view)
        full = n - n % self.stride
        for i in range(0, full, self.stride):
            self._window(view[i:i + self.stride].tobytes())
        if full < n:
            self._pending += view[full:]

    def _window(self, w: bytes) -> None:
        if self._window_no % self._every == 0 and self._window_no:
            self._mark()
        self._window_no += 1
        if self._is_text:
            if self._pos < SNIFF_BYTES and b"\x00" in w[:SNIFF_BYTES - self._pos]:
                self._is_text = False
            elif w.isascii() and not self._decoder.getstate()[0]:
                self._chars += len(w)  # ASCII at a character boundary: valid UTF-8, one char per byte (no decode)
            else:
                try:
                    self._chars += len(self._decoder.decode(w))
                except UnicodeDecodeError:
                    self._is_text = False
        nl = w.count(b"\n")
        if nl:
            self._newlines += nl
            self._line_start = self._pos + w.rfind(b"\n") + 1
        self._pos += len(w)
        self._last_byte = w[-1]

    def _mark(self) -> None:
        if self._line_start > self._line_offs[-1]:
            self._line_keys.append(self._newlines + 1)
            self._line_offs.append(self._line_start)
        if self._is_text:
            boundary = self._pos - len(self._decoder.getstate()[0])
            if boundary > self._char_offs[-1]:
                self._char_keys.append(self._chars)
                self._char_offs.append(boundary)
        if max(len(self._line_keys), len(self._char_keys)) > self.max_marks:
            for arr in (self._line_keys, self._line_offs, self._char_keys, self._char_offs):
                arr[:] = arr[::2]  # index 0 (the origin) always survives
            self._every *= 2

    def finish(self) -> TextIndex:
        if self._pending:
            self._window(bytes(self._pending))
            self._pending.clear()
        if self._is_text:
            try:
                self._chars += len(self._decoder.decode(b"", final=True))
            except UnicodeDecodeError:
                self._is_text = False
        size = self._pos
        # fs_read lines: split on \n, one trailing empty piece dropped
        lines = self._newlines + (1 if size and self._last_byte != 0x0A else 0)
        text = self._is_text
        return TextIndex(
            size=size, is_text=text, chars=self._chars if text else None, lines=lines if text else None,
            line_marks=Marks(self._line_keys, self._line_offs),
            char_marks=Marks(self._char_keys, self._char_offs) if text else origin_marks(0))


def index_bytes(data: bytes, stride: int = DEFAULT_STRIDE, max_marks: int = DEFAULT_MAX_MARKS) -> TextIndex:
    ix = Indexer(stride, max_marks)
    ix.feed(data)
    return ix.finish()
