"""Claim checks (large inputs): a tool output whose text is already in the blob store, measured while it streams
back, so the service never holds it whole.

The marker of a text depends only on its §3 excerpt (head, tail), its totals (lines, chars) and its sha256 —
``ctxbuild_codec.render_marker`` is a pure function of those fields, and ``apply_inflight`` only reads them from
the plan's :class:`~ctxbuild_codec.Cut` when the blob is written (which a claimed blob always is). So this module:

- counts bytes, chars and newlines of the streamed chunks (UTF-8 decoded incrementally: a chunk border inside a
  character is fine; a blob that is not UTF-8 text is refused);
- keeps only two windows: the first ``HEAD_CHARS + 1`` chars and the last ``TAIL_CHARS`` chars. The codec's
  ``excerpt`` snaps the head within the first ``HEAD_CHARS + 1`` chars and the tail within the last ``TAIL_CHARS``,
  so ``excerpt`` applied to the windows gives exactly the excerpt of the whole text (pinned against
  ``ctxbuild_codec.lanes.measure`` on random texts and chunkings in tests/unit/test_truncation_claims.py);
- asks the codec's own rules (``policy_for``, ``needs_trim``) whether the part is trimmed, and builds the opaque
  lane's plan around the measured cut, which ``apply_inflight`` turns into the marker.

Nothing here cuts text: every cut is ``ctxbuild_codec.excerpt``'s. (A streaming ``measure`` in libs/codec would
remove the window knowledge from this service; until then the equivalence test pins it.)
"""

from __future__ import annotations

import codecs
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ctxbuild_codec import HEAD_CHARS, TAIL_CHARS, Cut, TrimPlan, excerpt, needs_trim, policy_for, vfs_uri
from ctxbuild_codec.codecs import ERROR_TYPES
from ctxbuild_codec.lanes import count_newlines
from ctxbuild_platform.errors import InvalidPayload

HEAD_WINDOW = HEAD_CHARS + 1  # excerpt's head looks at text[:HEAD_CHARS + 1] (a newline at index HEAD_CHARS counts)
TAIL_WINDOW = TAIL_CHARS      # excerpt's tail starts at or after len - TAIL_CHARS
CLAIMABLE_TYPES = ("text", "error-text")


@dataclass(frozen=True, slots=True)
class Claim:
    part: int
    sha256: str
    size: int | None = None


def parse_claims(payload: Mapping[str, Any]) -> dict[int, Claim]:
    """The request's claims by part index; InvalidPayload for a claim that does not name a raw text output."""
    parts = payload["parts"]
    out: dict[int, Claim] = {}
    for c in payload.get("claims") or []:
        i, sha = c["part"], c["sha256"]
        if i >= len(parts):
            raise InvalidPayload(f"claim for part {i}: the step has {len(parts)} parts")
        if i in out:
            raise InvalidPayload(f"part {i} is claimed twice")
        if "uri" in c and c["uri"] != vfs_uri(sha):
            raise InvalidPayload(f"claim for part {i}: uri {c['uri']} is not the URI of sha256 {sha}")
        part = parts[i]
        output = part.get("output") or {}
        if output.get("type") not in CLAIMABLE_TYPES or output.get("value") != "":
            raise InvalidPayload(f"claimed part {i} must carry an empty text or error-text output "
                                 "(its text is in the blob store)")
        if part.get("offload") is not None:
            raise InvalidPayload(f"claimed part {i} carries offload provenance: a claim stands for a raw output")
        out[i] = Claim(i, sha, c.get("size"))
    return out


@dataclass(frozen=True, slots=True)
class Measured:
    """What the lane needs of a streamed text: the two excerpt windows, its totals, and the text itself only when
    it was small enough to keep (``kept``; None otherwise)."""

    head_window: str
    tail_window: str
    size: int
    chars: int
    lines: int
    kept: str | None


class ClaimMeter:
    """Feed it the blob's byte chunks in order; ``finish()`` gives the :class:`Measured` text."""

    def __init__(self, keep_max_bytes: int = 0) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("strict")
        self._keep_max = keep_max_bytes
        self._kept: list[str] | None = [] if keep_max_bytes > 0 else None
        self._head: list[str] = []
        self._head_len = 0
        self._tail = ""
        self.size = 0
        self.chars = 0
        self.newlines = 0

    def feed(self, data: bytes) -> None:
        self.size += len(data)
        self.newlines += count_newlines(data)
        try:
            text = self._decoder.decode(data)
        except UnicodeDecodeError as exc:
            raise InvalidPayload(f"the claimed blob is not UTF-8 text (byte {self.size - len(data) + exc.start})") \
                from exc
        self._take(text)

    def _take(self, text: str) -> None:
        if not text:
            return
        self.chars += len(text)
        if self._head_len < HEAD_WINDOW:
            piece = text[:HEAD_WINDOW - self._head_len]
            self._head.append(piece)
            self._head_len += len(piece)
        self._tail = text[-TAIL_WINDOW:] if len(text) >= TAIL_WINDOW else (self._tail + text)[-TAIL_WINDOW:]
        if self._kept is not None:
            if self.size <= self._keep_max:
                self._kept.append(text)
            else:
                self._kept = None  # too large to serve whole: only the windows are kept

    def finish(self) -> Measured:
        try:
            self._take(self._decoder.decode(b"", final=True))
        except UnicodeDecodeError as exc:
            raise InvalidPayload("the claimed blob ends inside a UTF-8 character") from exc
        kept = "".join(self._kept) if self._kept is not None else None
        return Measured("".join(self._head), self._tail, self.size, self.chars, self.newlines + 1, kept)


class _Length:
    """``needs_trim`` reads only ``len(text)``: the codec's rule, asked about a text this service never holds."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def measured_cut(m: Measured, sha256: str, key: str = "") -> Cut:
    """The codec's cut of the streamed text (what ``ctxbuild_codec.lanes.measure`` gives for the whole text),
    without its text: a claimed blob is already stored, so the inline fallback — the only reader of
    ``Cut.text`` — never applies to it."""
    head = excerpt(m.head_window, HEAD_CHARS, 0).head
    tail = excerpt(m.tail_window, 0, TAIL_CHARS).tail
    return Cut(key, sha256, vfs_uri(sha256), "", head, tail, m.lines, m.chars)


def claim_plan(part: Mapping[str, Any], threshold: int, sha256: str, m: Measured) -> TrimPlan | None:
    """The in-flight plan for a claimed part (the opaque lane, as ``plan_inflight`` makes it for a text output),
    or None when the codec's rules leave it untouched (not truncatable, or not over the threshold)."""
    if not policy_for(part).truncatable or not needs_trim(_Length(m.chars), threshold):  # type: ignore[arg-type]
        return None
    kind = part["output"]["type"]
    return TrimPlan("inflight", "opaque", threshold, (measured_cut(m, sha256),),
                    "error-text" if kind in ERROR_TYPES else "text")
