"""fs_read (SPEC §6, §15.2): a numbered page of an offloaded blob, the lines matching a pattern, or a model-facing
error result.

Results are plain dicts in the wire shape of ``ctx.blob.fs_read.reply.json``: an error here is a normal
*result* the model reads (``[Error: code] message``), not a typed error reply.

A line too long for one page is cut: the page shows a piece of it and says which ``column`` to ask for next, so
every character of a blob is reachable by paging (a long JSON one-liner included). A ``pattern`` (a regular
expression of the ``regex`` module, run with a time bound, so a catastrophic pattern costs at most that) returns
only the matching lines, rendered like a page and within the same cap.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import regex

NUMBER_WIDTH = 6
HINT_HEADROOM = 200  # room left under the cap for the continuation hint line
MATCH_CONTEXT = 200  # chars shown before a match when a matching line is too long to show whole


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


def nothing_to_read(offset: int, total: int, **extra: Any) -> dict[str, Any] | None:
    """The answer when no line is to be shown: an empty blob read from line 1 is readable (as nothing), not an
    out-of-range error (``extra``: fields of that empty page, e.g. a search's ``matches``); an offset past the
    end is ``offset-out-of-range``. None when there are lines to read."""
    if total == 0 and offset == 1:
        return {"kind": "text", "text": "", "startLine": 1, "endLine": 0, "totalLines": 0, **extra,
                "modelText": "[the file is empty: 0 lines]"}
    if offset > total:
        return fs_read_error("offset-out-of-range",
                             f"offset {offset} is past the end of the file ({total} lines); use 1..{total}")
    return None


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

    def __init__(self, *, first_line: int, offset: int, limit: int, total_lines: int, cap: int,
                 column: int = 1) -> None:
        if first_line > offset:
            raise ValueError("the stream must start at or before the requested line")
        self.offset, self.limit, self.total, self.cap = offset, limit, total_lines, cap
        # the page's first line is shown from ``column``; over the cap it is cut (its piece + where to go on)
        self.column = max(1, column)
        self.room = max(1, cap - HINT_HEADROOM - NUMBER_WIDTH - 1)
        self._first_open = True
        self._first_seen = 0
        self._first_buf: list[str] = []
        self._first_len = 0
        self.cut = False
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
            self._kept.extend([f"{i:>{NUMBER_WIDTH}}\t{t}" for i, t in enumerate(lines, first)])
        elif self._keep:
            self._keep = False
            self._kept.clear()
        if last >= self.last:
            self.done = True

    def _first_feed(self, seg: str) -> None:
        """Keep the window [column, column + room] of the first line (one char more than fits tells a cut)."""
        lo = self.column - 1 - self._first_seen
        want = self.room + 1 - self._first_len
        if want > 0 and lo < len(seg):
            chunk = seg[max(0, lo): max(0, lo) + want]
            self._first_buf.append(chunk)
            self._first_len += len(chunk)
        self._first_seen += len(seg)
        if self._first_len > self.room:   # over one page: cut here, nothing more to read
            self.cut = True
            self.done = True

    def _first_finish(self) -> None:
        self._first_open = False
        shown = "".join(self._first_buf)
        self._first_buf.clear()
        self._add(self._line, len(shown), shown)
        self._line += 1

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
        if self._first_open:
            nl = piece.find("\n")
            self._first_feed(piece if nl < 0 else piece[:nl])
            if nl < 0 or self.done:
                return self.done
            self._first_finish()
            piece = piece[nl + 1:]
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
        if (early := nothing_to_read(offset, total)) is not None:
            return early
        if self.cut:
            return self._cut_result()
        if not self.done and at_end and self._first_open and self._line == offset:
            self._first_finish()  # the page's only line, unterminated
        elif not self.done and at_end and offset <= self._line <= self.last:
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


    def _cut_result(self) -> dict[str, Any]:
        n, piece = self.offset, "".join(self._first_buf)[: self.room]
        first, nxt = self.column, self.column + len(piece)
        body = f"{n:>{NUMBER_WIDTH}}\t{piece}"
        hint = (f"\n\n[line {n} is longer than one page: showing its chars {first}-{nxt - 1}; call again with "
                f"offset={n}, column={nxt} to continue the line]")
        return {"kind": "text", "text": body, "startLine": n, "endLine": n, "totalLines": self.total,
                "nextColumn": nxt, "modelText": body + hint}


def compile_pattern(pattern: str) -> regex.Pattern | dict[str, Any]:
    """The compiled pattern, or an ``invalid-pattern`` error result the model reads."""
    try:
        return regex.compile(pattern)
    except (regex.error, ValueError, OverflowError, RecursionError) as exc:
        return fs_read_error("invalid-pattern", f"the pattern is not a valid regular expression: {exc}")


class LineSearch:
    """fs_read with a ``pattern``: fed the text from the start of line ``first_line`` (like :class:`LinePager`),
    keeps the lines in [offset, offset + limit − 1] the pattern matches, rendered like a page, until the cap.

    Every ``search`` runs with the ``regex`` module's timeout, against one deadline for the whole read: a
    catastrophic pattern (``(a+)+$`` on a long run of ``a``) answers ``pattern-timeout`` instead of hanging the
    service. A matching line too long to show whole is shown from a little before its first match, with the
    ``column`` to read it from.
    """

    def __init__(self, pattern: regex.Pattern, *, first_line: int, offset: int, limit: int | None,
                 total_lines: int, cap: int, timeout_s: float, clock=time.monotonic) -> None:
        if first_line > offset:
            raise ValueError("the stream must start at or before the requested line")
        self.pattern, self.offset, self.total, self.cap = pattern, offset, total_lines, cap
        self.last = total_lines if limit is None else min(total_lines, offset + limit - 1)
        self.clock, self.deadline, self.timeout_s = clock, clock() + timeout_s, timeout_s
        self.line_room = max(1, (cap - HINT_HEADROOM) // 4)   # one long match must leave room for others
        self._line = first_line
        self._partial: list[str] = []
        self._kept: list[str] = []
        self._rendered = 0
        self.matches = 0
        self.scanned_to = offset - 1   # the last line searched
        self.full = False              # the cap was reached: more lines may match
        self.timed_out = False
        self.done = self.last < offset

    def _check(self, n: int, line: str) -> None:
        remaining = self.deadline - self.clock()
        if remaining <= 0:
            raise TimeoutError
        m = self.pattern.search(line, timeout=remaining)
        if m is not None:
            if len(line) > self.line_room:
                start = max(0, m.start() - MATCH_CONTEXT)
                text = (line[start: start + self.line_room] + f" … [line {n} has {len(line)} chars; this piece "
                        f"starts at column {start + 1}: read on with offset={n}, column={start + 1}]")
            else:
                text = line
            rendered = f"{n:>{NUMBER_WIDTH}}\t{text}"
            if self._rendered + len(rendered) + 1 > self.cap - HINT_HEADROOM:
                self.full = True
                self.done = True
                return
            self._kept.append(rendered)
            self._rendered += len(rendered) + 1
            self.matches += 1
        self.scanned_to = n
        if n >= self.last:
            self.done = True

    def _line_done(self, line: str) -> None:
        n = self._line
        self._line += 1
        if n < self.offset or self.done:
            return
        try:
            self._check(n, line)
        except TimeoutError:
            self.timed_out = True
            self.done = True

    def feed(self, piece: str) -> bool:
        if self.done or not piece:
            return self.done
        lines = piece.split("\n")
        if len(lines) == 1:
            self._partial.append(piece)
            return False
        self._line_done("".join([*self._partial, lines[0]]))
        self._partial = [lines[-1]] if lines[-1] else []
        for line in lines[1:-1]:
            if self.done:
                break
            self._line_done(line)
        return self.done

    def result(self, at_end: bool = True) -> dict[str, Any]:
        offset, total = self.offset, self.total
        if (early := nothing_to_read(offset, total, matches=0)) is not None:
            return early
        if not self.done and at_end and self._partial:
            self._line_done("".join(self._partial))
            self._partial = []
        if self.timed_out:
            return fs_read_error("pattern-timeout",
                                 f"the pattern took longer than {self.timeout_s:g}s (stopped at line "
                                 f"{self.scanned_to + 1}); use a simpler pattern or a smaller offset/limit range")
        end = self.scanned_to
        body = "\n".join(self._kept)
        if self.full:
            note = (f"[{self.matches} matching lines shown, up to line {end}; more may match — call again with "
                    f"offset={end + 1} and the same pattern to continue]")
        elif self.matches:
            note = f"[{self.matches} matching lines in lines {offset}-{end} of {total}]"
        else:
            note = f"[no line matches the pattern in lines {offset}-{end} of {total}]"
        return {"kind": "text", "text": body, "startLine": offset, "endLine": end, "totalLines": total,
                "matches": self.matches, "modelText": f"{body}\n\n{note}" if body else note}


def count_lines(text: str) -> int:
    """len(split_lines(text)) without splitting."""
    return text.count("\n") + (0 if not text or text.endswith("\n") else 1)


def fs_read_page(text: str, offset: int = 1, limit: int = 2000, cap: int = 50_000, column: int = 1) -> dict[str, Any]:
    pager = LinePager(first_line=1, offset=offset, limit=limit, total_lines=count_lines(text), cap=cap, column=column)
    pager.feed(text)
    return pager.result()


def fs_read_search(text: str, pattern: str, offset: int = 1, limit: int | None = None, cap: int = 50_000,
                   timeout_s: float = 2.0) -> dict[str, Any]:
    compiled = compile_pattern(pattern)
    if isinstance(compiled, dict):
        return compiled
    search = LineSearch(compiled, first_line=1, offset=offset, limit=limit, total_lines=count_lines(text), cap=cap,
                        timeout_s=timeout_s)
    search.feed(text)
    return search.result()


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
