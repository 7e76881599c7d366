"""What the raw path says, independently of what is served: clear-context cut, maxMessages window, and the
retained context (attachments and archived tool outputs that stay readable — finding #2)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..records import archived_uris

Message = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Retained:
    file_attachments: list[dict[str, str]] = field(default_factory=list)
    persisted_uris: list[str] = field(default_factory=list)

    def to_payload(self) -> dict[str, Any]:
        return {"fileAttachments": [dict(a) for a in self.file_attachments],
                "persistedUris": list(self.persisted_uris)}


def after_clear(rows: Sequence[Message]) -> tuple[list[Message], bool]:
    """Rows after the last clear-context marker (the marker itself is dropped); whether anything was cut."""
    for i in range(len(rows) - 1, -1, -1):
        if rows[i].get("clearContext"):
            return list(rows[i + 1:]), True
    return list(rows), False


def max_messages_window(rows: Sequence[Message], n: int) -> list[Message]:
    """The last ``n`` rows, extended back to a ``user`` row (a window never starts inside a tool exchange)."""
    if n <= 0 or len(rows) <= n:
        return list(rows)
    start = len(rows) - n
    while start > 0 and rows[start].get("role") != "user":
        start -= 1
    return list(rows[start:])


def file_parts(rows: Iterable[Message]) -> Iterable[Mapping[str, Any]]:
    for row in rows:
        for part in row.get("parts") or []:
            if part.get("type") == "file":
                yield part


def persisted_uris(rows: Iterable[Message]) -> list[str]:
    """URIs of tool outputs ctxbuild archived (typed provenance only, ``ctxbuild_codec.records``), in order of
    first appearance: an in-flight ``offload`` (its blob, every codec blob of a trimmed entity or field, the
    original of a non-text or JSON output) and persisted envelopes. Text that merely looks like a marker is never
    a source."""
    return archived_uris(rows)


def attachment_handles(rows: Iterable[Message]) -> list[str]:
    """Handles of the files attached in these rows, in order of first appearance."""
    seen: dict[str, None] = {}
    for part in file_parts(rows):
        if part.get("handle"):
            seen.setdefault(part["handle"], None)
    return list(seen)


def retained_context(rows: Sequence[Message], attachments: Sequence[Mapping[str, Any]],
                     restrict: bool) -> Retained:
    """Retained context over the raw rows in scope.

    ``attachments`` is the conversation's authoritative list. With ``restrict`` (a clear-context marker or a
    maxMessages window cut rows away) only attachments referenced by a file part in ``rows`` stay readable;
    otherwise the whole list does. File parts missing from the list are added from the part itself.
    """
    parts = list(file_parts(rows))
    handles = {p.get("handle") for p in parts}
    shas = {p.get("sha256") for p in parts}
    out: list[dict[str, str]] = []
    have: set[str] = set()
    for a in attachments:
        if restrict and a.get("handle") not in handles and a.get("sha256") not in shas:
            continue
        if a.get("handle") in have:
            continue
        have.add(a["handle"])
        out.append({"sha256": a["sha256"], "handle": a["handle"], "displayName": a.get("displayName", a["handle"])})
    for p in parts:
        if p.get("handle") and p["handle"] not in have:
            have.add(p["handle"])
            out.append({"sha256": p["sha256"], "handle": p["handle"],
                        "displayName": p.get("displayName", p["handle"])})
    return Retained(out, persisted_uris(rows))
