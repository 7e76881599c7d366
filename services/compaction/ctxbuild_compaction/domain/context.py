"""What the raw path says, independently of what is served: clear-context cut, maxMessages window, and the
retained context (attachments and archived tool outputs that stay readable — finding #2)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ctxbuild_codec import handle_prefix_from_uri
from ctxbuild_codec.trim import VFS_SCHEME

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


def _uri_of(vfs_filename: Any) -> str | None:
    if not isinstance(vfs_filename, str) or handle_prefix_from_uri(vfs_filename) is None:
        return None
    return vfs_filename if vfs_filename.startswith(VFS_SCHEME) else VFS_SCHEME + vfs_filename


def persisted_uris(rows: Iterable[Message]) -> list[str]:
    """URIs of tool outputs ctxbuild archived (typed provenance only), in order of first appearance.

    From ``offload.uri`` (in-flight) and from persisted envelopes (``vfsFilename`` of v1, ``blobRefs`` of v2).
    Text that merely looks like a marker is never a source.
    """
    seen: dict[str, None] = {}
    for row in rows:
        for part in row.get("parts") or []:
            if part.get("type") != "tool-result":
                continue
            offload = part.get("offload") or {}
            candidates = [offload.get("uri"), (offload.get("original") or {}).get("uri")] \
                if offload.get("mode") == "offloaded" else []  # original: a non-text output (SPEC §15.1)
            output = part.get("output") or {}
            if output.get("type") == "persisted" and isinstance(output.get("value"), Mapping):
                env = output["value"]
                candidates.append(env.get("vfsFilename"))
                candidates += [r.get("vfsFilename") for r in env.get("blobRefs") or [] if isinstance(r, Mapping)]
            for c in candidates:
                uri = _uri_of(c)
                if uri is not None:
                    seen.setdefault(uri, None)
    return list(seen)


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
