"""The trim primitive (SPEC §3): one implementation for the in-flight and the persist lane.

Everything here is a pure function of its inputs, so the same text always renders to the same bytes
(provider prefix caches keep hitting across steps and turns).
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

HEAD_CHARS = 500
TAIL_CHARS = 1000
PERSIST_MIN_CHARS = 1500
VFS_SCHEME = "context://vfs/"


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def vfs_handle(sha256: str) -> str:
    """The 16-hex handle name; only a handle — the full sha256 is the identity."""
    return f"vfs_{sha256[:16]}.txt"


def vfs_uri(sha256: str) -> str:
    return VFS_SCHEME + vfs_handle(sha256)


def handle_prefix_from_uri(uri: str) -> str | None:
    """`context://vfs/vfs_<16 hex>.txt` or `vfs_<16 hex>.txt` → the 16-hex prefix; None if malformed."""
    name = uri.removeprefix(VFS_SCHEME)
    if not (name.startswith("vfs_") and name.endswith(".txt")):
        return None
    prefix = name[4:-4]
    if len(prefix) != 16 or any(c not in "0123456789abcdef" for c in prefix):
        return None
    return prefix


def total_lines(text: str) -> int:
    return text.count("\n") + 1


class Excerpt(NamedTuple):
    head: str
    tail: str
    total_lines: int
    total_chars: int


def excerpt(text: str, head: int = HEAD_CHARS, tail: int = TAIL_CHARS, *, lines: int | None = None) -> Excerpt:
    """Head snapped back to a line end, tail snapped forward to a line start (§3).

    ``lines`` lets a caller that already counted the text's lines (e.g. on its UTF-8 bytes) pass the count.
    """
    n = len(text)
    if head <= 0:
        h = ""
    else:
        cut = text.rfind("\n", 0, min(head, n - 1) + 1) if n else -1
        h = text[: cut + 1] if cut >= 0 else text[:head]
    if tail <= 0:
        t = ""
    else:
        start = max(0, n - tail)
        nl = text.find("\n", start)
        t = text[nl + 1:] if nl >= 0 else text[start:]
    return Excerpt(h, t, total_lines(text) if lines is None else lines, n)


def needs_trim(text: str, threshold: int, head: int = HEAD_CHARS, tail: int = TAIL_CHARS) -> bool:
    """In-flight rule (§3): trimmed only when longer than the threshold and than head + tail."""
    return len(text) > threshold and head + tail < len(text)


def needs_persist_trim(text: str, threshold: int, head: int = HEAD_CHARS, tail: int = TAIL_CHARS) -> bool:
    """Persist rule (§2.3): longer than both the threshold and 1,500 chars (and than head + tail)."""
    return needs_trim(text, max(threshold, PERSIST_MIN_CHARS), head, tail)


GONE_LINE = "Full output no longer available (the archived copy was deleted); only the excerpt remains.\n"
_READ_HINT = "Read the full content with the fs_read tool (pass the URI above; page with offset/limit).\n"


def render_marker(head: str, tail: str, total_lines_: int, total_chars: int, uri: str | None) -> str:
    """The offloaded marker from stored fields; the persist lane renders envelopes back through this.

    Pieces (head, block, tail; empty ones dropped) joined with a blank line, the whole stripped (§3).
    ``uri=None`` is a blob that is gone: the same marker without a readable URI (nothing to call fs_read on).
    """
    where = f"Full output: {uri}\n{_READ_HINT}" if uri is not None else GONE_LINE
    if head:
        shown = (f"first {len(head)} chars shown above, last {len(tail)} chars shown below" if tail
                 else f"first {len(head)} chars shown above, rest omitted")
    else:
        shown = f"preceding content omitted, last {len(tail)} chars shown below" if tail else "preview omitted"
    block = (f"<persisted-output>\noutput truncated ({total_lines_} lines, {total_chars} chars total; {shown})\n"
             f"{where}</persisted-output>")
    return "\n\n".join([piece for piece in (head, block, tail) if piece]).strip()


def marker(text: str, head: int = HEAD_CHARS, tail: int = TAIL_CHARS) -> str:
    ex = excerpt(text, head, tail)
    return render_marker(ex.head, ex.tail, ex.total_lines, ex.total_chars, vfs_uri(sha256_hex(text)))


def inline_truncate(text: str, head: int = HEAD_CHARS, tail: int = TAIL_CHARS) -> str:
    """Fallback without storage: no line snapping, empty pieces dropped, result stripped."""
    h = text[:head] if head > 0 else ""
    t = text[len(text) - tail:] if tail > 0 else ""
    mid = f"\n--- truncated ({total_lines(text)} lines, {len(text)} chars total) ---\n"
    return "".join(p for p in (h, mid, t) if p).strip()


def degraded_excerpt(head: str, tail: str) -> str:
    """Read-back of a persisted text whose blob is gone (§7): the stored excerpt, said to be one."""
    shown = len(head) + len(tail)
    return f"{head}\n\n[persisted output no longer available — showing excerpt of {shown} chars]\n\n{tail}"
