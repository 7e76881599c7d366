"""The trim primitive (SPEC §3): one implementation for the in-flight and the persist lane.

Everything here is a pure function of its inputs, so the same text always renders to the same bytes
(provider prefix caches keep hitting across steps and turns).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

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
    name = uri[len(VFS_SCHEME):] if uri.startswith(VFS_SCHEME) else uri
    if not (name.startswith("vfs_") and name.endswith(".txt")):
        return None
    prefix = name[4:-4]
    if len(prefix) != 16 or any(c not in "0123456789abcdef" for c in prefix):
        return None
    return prefix


def total_lines(text: str) -> int:
    return text.count("\n") + 1


@dataclass(frozen=True, slots=True)
class Excerpt:
    head: str
    tail: str
    total_lines: int
    total_chars: int


def excerpt(text: str, head: int = HEAD_CHARS, tail: int = TAIL_CHARS) -> Excerpt:
    """Head snapped back to a line end, tail snapped forward to a line start (§3)."""
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
    return Excerpt(h, t, total_lines(text), n)


def needs_trim(text: str, threshold: int, head: int = HEAD_CHARS, tail: int = TAIL_CHARS) -> bool:
    return len(text) > threshold and head + tail < len(text)


def _descriptor(h: int, t: int) -> str:
    if h and t:
        return f"; first {h} chars shown above, last {t} chars shown below"
    if h:
        return f"; first {h} chars shown above, rest omitted"
    if t:
        return f"; preceding content omitted, last {t} chars shown below"
    return "; preview omitted"


def render_marker(head: str, tail: str, total_lines_: int, total_chars: int, uri: str) -> str:
    """The offloaded marker from stored fields; the persist lane renders envelopes back through this."""
    block = (
        "\n<persisted-output>\n"
        f"output truncated ({total_lines_} lines, {total_chars} chars total{_descriptor(len(head), len(tail))})\n"
        f"Full output: {uri}\n"
        "Read the full content with the fs_read tool (pass the URI above; page with offset/limit).\n"
        "</persisted-output>\n"
    )
    pieces = [p for p in (head, block, tail) if p]
    return "\n".join(pieces).strip()


def marker(text: str, head: int = HEAD_CHARS, tail: int = TAIL_CHARS) -> str:
    ex = excerpt(text, head, tail)
    return render_marker(ex.head, ex.tail, ex.total_lines, ex.total_chars, vfs_uri(sha256_hex(text)))


def inline_truncate(text: str, head: int = HEAD_CHARS, tail: int = TAIL_CHARS) -> str:
    """Fallback without storage: no line snapping, empty pieces dropped, result stripped."""
    h = text[:head] if head > 0 else ""
    t = text[len(text) - tail:] if tail > 0 else ""
    mid = f"\n--- truncated ({total_lines(text)} lines, {len(text)} chars total) ---\n"
    return "".join(p for p in (h, mid, t) if p).strip()
