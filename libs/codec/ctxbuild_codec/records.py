"""One reader per stored record that several services read: the blobs a tool result archived, a message's usage.

Typed provenance only (SPEC §1): a URI counts because a record names it — ``offload`` of an in-flight trim (its
single blob, every codec blob in ``blobs``, the ``original`` of a non-text or JSON output) or a persisted v1/v2
envelope (``vfsFilename``, ``blobRefs``, ``original``) — never because text looks like a marker.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .trim import VFS_SCHEME, handle_prefix_from_uri


@dataclass(frozen=True, slots=True)
class ArchivedBlob:
    """One blob a tool result's full text (or original) was kept in."""

    uri: str  # context://vfs/vfs_<16 hex>.txt
    sha256: str | None  # when the record names it
    tool_call_id: str | None


def vfs_uri_of(name: Any) -> str | None:
    """``vfs_<16 hex>.txt`` or its ``context://vfs/`` URI → the URI; None for anything else."""
    if not isinstance(name, str) or handle_prefix_from_uri(name) is None:
        return None
    return name if name.startswith(VFS_SCHEME) else VFS_SCHEME + name


def _sha(value: Any) -> str | None:
    return value if isinstance(value, str) and len(value) == 64 else None


def offload_of(part: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """A tool-result part's ``offload`` record when it says the output was offloaded (``mode: offloaded``)."""
    offload = part.get("offload")
    return offload if isinstance(offload, Mapping) and offload.get("mode") == "offloaded" else None


def _offload_refs(offload: Mapping[str, Any]) -> Iterator[tuple[Any, Any]]:
    yield offload.get("uri"), offload.get("sha256")
    for row in offload.get("blobs") or []:
        if isinstance(row, Mapping):
            yield row.get("uri"), row.get("sha256")
    original = offload.get("original")
    if isinstance(original, Mapping):
        yield original.get("uri"), original.get("sha256")


def _envelope_refs(envelope: Mapping[str, Any]) -> Iterator[tuple[Any, Any]]:
    for ref in [envelope, *(r for r in envelope.get("blobRefs") or [] if isinstance(r, Mapping))]:
        yield ref.get("vfsFilename"), ref.get("fileEntryId")
    original = envelope.get("original")
    if isinstance(original, Mapping):
        yield original.get("vfsFilename"), original.get("fileEntryId")


def archived_blobs(part: Mapping[str, Any]) -> list[ArchivedBlob]:
    """Every blob a tool-result part names (in record order, without repeats); [] for any other part."""
    if not isinstance(part, Mapping) or part.get("type") != "tool-result":
        return []
    refs: list[tuple[Any, Any]] = []
    if (offload := offload_of(part)) is not None:
        refs += _offload_refs(offload)
    output = part.get("output")
    if isinstance(output, Mapping) and output.get("type") == "persisted" and isinstance(output.get("value"), Mapping):
        refs += _envelope_refs(output["value"])
    call_id = part.get("toolCallId")
    seen: dict[str, ArchivedBlob] = {}
    for name, sha in refs:
        uri = vfs_uri_of(name)
        if uri is not None and uri not in seen:
            seen[uri] = ArchivedBlob(uri, _sha(sha), call_id if isinstance(call_id, str) else None)
    return list(seen.values())


def archived_uris(messages: Iterable[Mapping[str, Any]]) -> list[str]:
    """The URIs of every blob the messages' tool results name, in order of first appearance."""
    seen: dict[str, None] = {}
    for message in messages:
        for part in message.get("parts") or []:
            for blob in archived_blobs(part):
                seen.setdefault(blob.uri, None)
    return list(seen)


def usage_of(message: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The provider usage an assistant message carries (``contracts/model/usage.json``), or None."""
    usage = message.get("usage")
    return usage if message.get("role") == "assistant" and isinstance(usage, Mapping) else None


def usage_tokens(usage: Mapping[str, Any]) -> int:
    """The size of the request that produced it plus its answer: inputTokens + outputTokens."""
    return int(usage.get("inputTokens") or 0) + int(usage.get("outputTokens") or 0)
