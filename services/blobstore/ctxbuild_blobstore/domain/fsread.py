"""fs_read (SPEC §6): a numbered page of an offloaded blob, or a model-facing error result.

Results are plain dicts in the wire shape of ``ctx.blob.fs_read.reply.json``: an error here is a normal
*result* the model reads (``[Error: code] message``), not a typed error reply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

NUMBER_WIDTH = 6
HINT_HEADROOM = 200  # room left under the cap for the continuation hint line


def split_lines(text: str) -> list[str]:
    """Split on ``\\n``; one trailing empty piece (a final newline) is dropped, so "" has no lines."""
    pieces = text.split("\n")
    if pieces[-1] == "":
        pieces.pop()
    return pieces


def render_lines(lines: Sequence[str], first: int) -> str:
    return "\n".join(f"{n:>{NUMBER_WIDTH}}\t{line}" for n, line in enumerate(lines, start=first))


def fs_read_error(code: str, message: str) -> dict[str, Any]:
    return {"kind": "error", "code": code, "message": message, "modelText": f"[Error: {code}] {message}"}


def not_found(prefix: str) -> dict[str, Any]:
    """The one answer for a missing blob and (in a model's read) for a blob outside the read's allow-list."""
    return fs_read_error("not-found", f"no stored output vfs_{prefix}.txt")


def suggested_limit(page_chars: int, page_lines: int, cap: int) -> int:
    """max(1, floor((cap − 200) / average rendered line length)); integer arithmetic, no float rounding."""
    return max(1, ((cap - HINT_HEADROOM) * page_lines) // page_chars)


class LinePager:
    """fs_read over a stream: feed decoded text that starts at the beginning of line ``first_line``; the result
    is identical to :func:`fs_read_page` on the whole text, with memory bounded by the cap (a page over the cap
    is only counted, never held, so the suggested limit stays exact even for a 100 MB line).

    ``total_lines`` comes from the blob's index. :meth:`feed` returns True once the page is complete.
    """

    def __init__(self, *, first_line: int, offset: int, limit: int, total_lines: int, cap: int) -> None:
        if first_line > offset:
            raise ValueError("the stream must start at or before the requested line")
        self.offset, self.limit, self.total, self.cap = offset, limit, total_lines, cap
        self.last = min(total_lines, offset + limit - 1)  # the page's last line
        self._line = first_line  # number of the line being read
        self._cur: list[str] = []  # pieces of the current line (only while they are kept)
        self._cur_len = 0
        self._rendered = 0  # rendered chars of the finished page lines (incl. the joining newlines)
        self._count = 0
        self._kept: list[str] = []
        self._keep = True
        self.done = self.last < offset  # offset past the end (or an empty blob): nothing to read

    def _finish_line(self) -> None:
        self._add(self._line, self._cur_len, "".join(self._cur) if self._keep else "")
        self._cur.clear()
        self._cur_len = 0
        self._line += 1

    def _add(self, n: int, length: int, text: str) -> None:
        """Account one finished page line (number ``n``, ``length`` chars)."""
        self._rendered += (1 if self._count else 0) + max(NUMBER_WIDTH, len(str(n))) + 1 + length
        self._count += 1
        if self._keep and self._rendered <= self.cap:
            self._kept.append(f"{n:>{NUMBER_WIDTH}}\t{text}")
        elif self._keep:
            self._keep = False
            self._kept.clear()
        if n >= self.last:
            self.done = True

    def _add_many(self, first: int, lines: list[str]) -> None:
        """:meth:`_add` for a run of lines (same arithmetic; text is kept per run, bounded by one piece)."""
        k = len(lines)
        if not k:
            return
        last = first + k - 1
        if last < 10 ** NUMBER_WIDTH:
            numbers = (NUMBER_WIDTH + 1) * k
        else:
            numbers = sum(max(NUMBER_WIDTH, len(str(i))) + 1 for i in range(first, last + 1))
        self._rendered += (k if self._count else k - 1) + numbers + sum(map(len, lines))
        self._count += k
        if self._keep and self._rendered <= self.cap:
            self._kept.extend([f"{i:>{NUMBER_WIDTH}}\t{t}" for i, t in zip(range(first, last + 1), lines)])
        elif self._keep:
            self._keep = False
            self._kept.clear()
        if last >= self.last:
            self.done = True

    def feed(self, piece: str) -> bool:
        """Whole runs of lines are handled by C-level ``count``/``split``; only page lines cost Python work."""
        if self.done or not piece:
            return self.done
        if self._line < self.offset:  # still skipping
            skip = self.offset - self._line
            if piece.count("\n") < skip:
                self._line += piece.count("\n")
                return False
            piece = piece.split("\n", skip)[-1]
            self._line = self.offset
        while piece and not self.done:
            nl = piece.find("\n")
            if nl < 0:  # a partial line: held only while it can still fit the cap
                self._cur_len += len(piece)
                if self._keep:
                    if self._cur_len > self.cap:
                        self._keep = False
                        self._kept.clear()
                        self._cur.clear()
                    else:
                        self._cur.append(piece)
                return False
            head = piece[:nl]
            if self._cur_len or self._cur:
                self._cur_len += len(head)
                if self._keep:
                    self._cur.append(head)
                self._finish_line()
            else:
                self._add(self._line, len(head), head)
                self._line += 1
            piece = piece[nl + 1:]
            if self.done or not piece:
                break
            # the lines complete within this piece, at C speed
            want = self.last - self._line + 1
            parts = piece.split("\n", want)
            if len(parts) > want:  # the page ends inside this piece
                complete, rest = parts[:want], ""
            else:
                complete, rest = parts[:-1], parts[-1]
            self._add_many(self._line, complete)
            self._line += len(complete)
            piece = rest
        return self.done

    def result(self, at_end: bool = True) -> dict[str, Any]:
        """The reply, once fed to the end of the page or of the text (``at_end``: the stream reached the blob's
        last byte, so an unterminated last line is complete)."""
        offset, total = self.offset, self.total
        if total == 0 and offset == 1:
            # an empty blob is readable (as nothing), not an out-of-range error
            return {"kind": "text", "text": "", "startLine": 1, "endLine": 0, "totalLines": 0,
                    "modelText": "[the file is empty: 0 lines]"}
        if offset > total:
            return fs_read_error("offset-out-of-range",
                                 f"offset {offset} is past the end of the file ({total} lines); use 1..{total}")
        if not self.done and at_end and offset <= self._line <= self.last:
            self._finish_line()  # the unterminated last line
        if self._count != self.last - offset + 1:
            raise ValueError(f"stream ended after {self._count} of {self.last - offset + 1} page lines")
        end = self.last
        if self._rendered > self.cap:
            if self._count == 1:
                # a single line over the cap cannot be paged by lines; say so instead of suggesting limit=1 again
                return fs_read_error("output-too-large",
                                     f"line {offset} alone renders to {self._rendered} chars, over the "
                                     f"{self.cap}-char read cap; it cannot be shown by fs_read")
            s = suggested_limit(self._rendered, self._count, self.cap)
            return fs_read_error("output-too-large",
                                 f"lines {offset}-{end} render to {self._rendered} chars, over the {self.cap}-char "
                                 f"read cap; call again with limit={s}")
        body = "\n".join(self._kept)
        model_text = body
        remaining = total - end
        if remaining > 0:
            model_text += (f"\n\n[showing lines {offset}-{end} of {total}; {remaining} more — "
                           f"call again with offset={end + 1} to continue]")
        return {"kind": "text", "text": body, "startLine": offset, "endLine": end, "totalLines": total,
                "modelText": model_text}


def count_lines(text: str) -> int:
    """len(split_lines(text)) without splitting."""
    return text.count("\n") + (0 if not text or text.endswith("\n") else 1)


def fs_read_page(text: str, offset: int = 1, limit: int = 2000, cap: int = 50_000) -> dict[str, Any]:
    pager = LinePager(first_line=1, offset=offset, limit=limit, total_lines=count_lines(text), cap=cap)
    pager.feed(text)
    return pager.result()


@dataclass(frozen=True, slots=True)
class Candidate:
    """A blob whose sha256 starts with the requested 16-hex prefix."""

    sha256: str
    size: int
    allowed: bool  # the conversation holds a reference to it


@dataclass(frozen=True, slots=True)
class Resolved:
    sha256: str
    size: int


def resolve_prefix(prefix: str, candidates: Sequence[Candidate], *,
                   uniform: bool = False) -> Resolved | dict[str, Any]:
    """Map a 16-hex handle to exactly one readable blob, or an error result.

    The handle is only a name: two blobs sharing it are never served (either could be the wrong one).
    Access is checked before ambiguity so an unrelated conversation learns nothing beyond "denied". ``uniform``
    (a model's read, SPEC §6): a blob the caller may not read answers exactly like one that does not exist, so
    the model learns nothing of what other conversations, branches or revoked messages hold. A trusted caller
    without a read scope keeps the distinct ``access-denied`` as a diagnostic.
    """
    if not candidates or (uniform and not any(c.allowed for c in candidates)):
        return not_found(prefix)
    if not any(c.allowed for c in candidates):
        return fs_read_error("access-denied", f"vfs_{prefix}.txt is not readable from this conversation")
    if len(candidates) > 1:
        return fs_read_error("ambiguous-handle",
                             f"vfs_{prefix}.txt names {len(candidates)} different stored outputs; refusing to "
                             "guess which one")
    c = candidates[0]
    return Resolved(c.sha256, c.size)
