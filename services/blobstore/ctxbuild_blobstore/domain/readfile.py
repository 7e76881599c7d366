"""read_file (SPEC §6): a character page of an attachment, by its per-conversation handle.

Chars are code points (the service works on Python ``str``), so a surrogate pair — one astral code point — is
never split, and ``limit ≥ 1`` makes every call advance.
"""

from __future__ import annotations

from typing import Any


def read_file_error(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}, "modelText": f"[Error: {code}] {message}"}


def read_file_not_found(name: str, known: list[str]) -> dict[str, Any]:
    """The one answer for a handle that names nothing the caller may read (missing, revoked, elsewhere)."""
    hint = f"; attached files: {', '.join(known)}" if known else "; this conversation has no attachments"
    return read_file_error("not-found", f"no attached file named {name!r}{hint}")


def read_file_range_error(offset: int, total: int) -> dict[str, Any] | None:
    """The offset-out-of-range result, or None when ``offset`` is a valid start."""
    if offset > total or (offset == total and total > 0):
        valid = f"; use 0..{total - 1}" if total else ""
        return read_file_error("offset-out-of-range",
                               f"offset {offset} is past the end of the file ({total} chars){valid}")
    return None


class CharPager:
    """read_file over a stream: feed decoded text starting at char ``first_char``; same result as
    :func:`read_file_page` on the whole text. Holds at most ``limit`` chars."""

    def __init__(self, *, first_char: int, offset: int, limit: int, total_chars: int) -> None:
        if first_char > offset:
            raise ValueError("the stream must start at or before the requested char")
        self.offset, self.total = offset, total_chars
        self.limit = max(1, limit)
        self._skip = offset - first_char
        self._parts: list[str] = []
        self._got = 0
        self.done = read_file_range_error(offset, total_chars) is not None or offset >= total_chars

    def feed(self, piece: str) -> bool:
        if self.done:
            return True
        if self._skip:
            if len(piece) <= self._skip:
                self._skip -= len(piece)
                return False
            piece = piece[self._skip:]
            self._skip = 0
        take = piece[: self.limit - self._got]
        self._parts.append(take)
        self._got += len(take)
        if self._got >= self.limit or self.offset + self._got >= self.total:
            self.done = True
        return self.done

    def result(self) -> dict[str, Any]:
        err = read_file_range_error(self.offset, self.total)
        if err is not None:
            return err
        page = "".join(self._parts)
        expected = min(self.limit, self.total - self.offset)
        if len(page) != expected:
            raise ValueError(f"stream ended after {len(page)} of {expected} chars")
        nxt = self.offset + len(page)
        out: dict[str, Any] = {"text": page, "totalChars": self.total, "modelText": page}
        if nxt < self.total:
            out["nextOffset"] = nxt
            out["modelText"] = (page + f"\n\n[Showing {len(page)} of {self.total} chars. "
                                       f"Call read_file again with offset={nxt} for more.]")
        return out


def read_file_page(text: str, offset: int = 0, limit: int = 8000) -> dict[str, Any]:
    pager = CharPager(first_char=0, offset=offset, limit=limit, total_chars=len(text))
    pager.feed(text)
    return pager.result()
