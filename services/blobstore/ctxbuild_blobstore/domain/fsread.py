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


def suggested_limit(page_chars: int, page_lines: int, cap: int) -> int:
    """max(1, floor((cap − 200) / average rendered line length)); integer arithmetic, no float rounding."""
    return max(1, ((cap - HINT_HEADROOM) * page_lines) // page_chars)


def fs_read_page(text: str, offset: int = 1, limit: int = 2000, cap: int = 50_000) -> dict[str, Any]:
    lines = split_lines(text)
    total = len(lines)
    if total == 0 and offset == 1:
        # an empty blob is readable (as nothing), not an out-of-range error
        return {"kind": "text", "text": "", "startLine": 1, "endLine": 0, "totalLines": 0,
                "modelText": "[the file is empty: 0 lines]"}
    if offset > total:
        return fs_read_error("offset-out-of-range",
                             f"offset {offset} is past the end of the file ({total} lines); use 1..{total}")
    page = lines[offset - 1: offset - 1 + limit]
    end = offset + len(page) - 1
    body = render_lines(page, offset)
    if len(body) > cap:
        s = suggested_limit(len(body), len(page), cap)
        if len(page) == 1:
            # a single line over the cap cannot be paged by lines; say so instead of suggesting limit=1 again
            return fs_read_error("output-too-large",
                                 f"line {offset} alone renders to {len(body)} chars, over the {cap}-char read "
                                 f"cap; it cannot be shown by fs_read")
        return fs_read_error("output-too-large",
                             f"lines {offset}-{end} render to {len(body)} chars, over the {cap}-char read cap; "
                             f"call again with limit={s}")
    model_text = body
    remaining = total - end
    if remaining > 0:
        model_text += (f"\n\n[showing lines {offset}-{end} of {total}; {remaining} more — "
                       f"call again with offset={end + 1} to continue]")
    return {"kind": "text", "text": body, "startLine": offset, "endLine": end, "totalLines": total,
            "modelText": model_text}


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


def resolve_prefix(prefix: str, candidates: Sequence[Candidate]) -> Resolved | dict[str, Any]:
    """Map a 16-hex handle to exactly one readable blob, or an error result.

    The handle is only a name: two blobs sharing it are never served (either could be the wrong one).
    Access is checked before ambiguity so an unrelated conversation learns nothing beyond "denied".
    """
    if not candidates:
        return fs_read_error("not-found", f"no stored output vfs_{prefix}.txt")
    if not any(c.allowed for c in candidates):
        return fs_read_error("access-denied", f"vfs_{prefix}.txt is not readable from this conversation")
    if len(candidates) > 1:
        return fs_read_error("ambiguous-handle",
                             f"vfs_{prefix}.txt names {len(candidates)} different stored outputs; refusing to "
                             "guess which one")
    c = candidates[0]
    return Resolved(c.sha256, c.size)
