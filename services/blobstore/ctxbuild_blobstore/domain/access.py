"""What a read may see (SPEC §6, §15): the retained context of the history being served, not the whole
conversation.

A turn's reads (fs_read, read_file) carry the retained context its turn-start compaction returned and the turn's
id. A blob is readable when the conversation references it AND it is in that retained context (an archived
output's URI or a retained attachment), or a fold transcript in that retained context lists it as a member (the
folded rows' outputs: recorded by the store when compaction put the transcript, never taken from the reader), or
the turn itself references it (its own offloads, claims, checkpoints).
What a ``maxMessages`` window or a clear-context marker revoked, and what only another branch references, is not
readable. A read without ``retained`` (a trusted caller such as a UI read-back) keeps the conversation-wide rule.
Every refusal answers like a blob that does not exist (no oracle).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ctxbuild_codec.trim import handle_prefix_from_uri


class RetainedAttachment(Protocol):
    sha256: str
    handle: str


class Retained(Protocol):
    """A request's ``retained`` (the fs_read and read_file request models each generate one of this shape)."""

    @property
    def fileAttachments(self) -> Sequence[RetainedAttachment]: ...

    @property
    def persistedUris(self) -> Sequence[str]: ...


@dataclass(frozen=True, slots=True)
class ReadScope:
    """The retained context a read is limited to (None in a request = conversation-wide)."""

    prefixes: frozenset[str]  # 16-hex handles of retained archived outputs and attachments
    attachment_shas: frozenset[str]
    handles: tuple[str, ...]  # retained attachment handles, in the retained order (shown in a not-found hint)
    turn_id: str | None

    @classmethod
    def of(cls, retained: Retained | None, turn_id: str | None) -> ReadScope | None:
        if retained is None:
            return None
        atts = retained.fileAttachments
        shas = frozenset(a.sha256 for a in atts)
        prefixes = {p for u in retained.persistedUris if (p := handle_prefix_from_uri(u)) is not None}
        prefixes |= {s[:16] for s in shas}
        handles = tuple(dict.fromkeys(a.handle for a in atts))
        return cls(frozenset(prefixes), shas, handles, turn_id)

    def retains_prefix(self, prefix: str) -> bool:
        return prefix in self.prefixes

    def retains_attachment(self, handle: str, sha256: str) -> bool:
        return handle in self.handles or sha256 in self.attachment_shas
