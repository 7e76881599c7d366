"""Masking an archived tool output (SPEC §10, §15.4): the output ctxbuild already archived becomes the codec's
marker for the same blob(s) with the preview omitted, so it costs a few tokens and stays readable with fs_read.

One function for both callers: compaction's ``masking`` summarizer and the runner's in-process fallback
(``window_fit``). Typed provenance only (``ctxbuild_codec.records``): an output counts as archived because its
record names the blobs, never because its text looks like a marker.

- a ``persisted`` envelope (v1/v2) → rendered with empty head and tail for every blob;
- an in-flight offload with one blob (``offload.uri``) → its marker; a non-text original (``original.of ==
  "output"``: images, resources, …) keeps its non-text markers, which name the original's blob;
- a codec offload of a ``json`` output (``offload.blobs``: trimmed entities or fields) → the same JSON with every
  offloaded field replaced by its preview-less marker;
- anything else (not archived, an offload that wrote no blob, or already masked) → None.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .codecs import assemble
from .envelopes import EnvelopeError, parse, render_part
from .nontext import OF_OUTPUT, render_with_markers
from .records import offload_of
from .trim import render_marker

TEXT_TYPES = ("text", "error-text")


def blank_envelope(envelope: Mapping[str, Any]) -> dict[str, Any]:
    """A persisted envelope with the preview (head and tail) of every blob emptied."""
    if "blobRefs" in envelope:
        return {**envelope, "blobRefs": [{**r, "head": "", "tail": ""} for r in envelope["blobRefs"]]}
    return {**envelope, "head": "", "tail": ""}


def _masked_offload(offload: Mapping[str, Any], output: Mapping[str, Any]) -> dict[str, Any] | None:
    if offload.get("uri"):
        kind = output.get("type") if output.get("type") in TEXT_TYPES else "text"
        value = render_marker("", "", int(offload.get("totalLines", 1)), int(offload.get("totalChars", 0)),
                              offload["uri"])
        original = offload.get("original")
        if isinstance(original, Mapping) and original.get("of") == OF_OUTPUT:
            value = render_with_markers(value, original.get("parts") or [], original.get("uri"))
        return {"type": kind, "value": value}
    blobs = offload.get("blobs") or []
    if blobs and output.get("type") == "json":
        texts = {b["key"]: render_marker("", "", int(b["totalLines"]), int(b["totalChars"]), b["uri"])
                 for b in blobs if b.get("uri")}
        return {"type": "json", "value": assemble(output.get("value"), texts)}
    return None


def masked_part(part: Mapping[str, Any]) -> dict[str, Any] | None:
    """The tool-result part with its archived output masked; None when the output is not archived by ctxbuild (or
    is masked already). The part's ``offload`` record is kept, so every blob it names stays retained."""
    output = part.get("output") or {}
    if output.get("type") == "persisted" and isinstance(output.get("value"), Mapping):
        try:
            parse(output["value"])
        except EnvelopeError:
            return None
        return render_part({**part, "output": {"type": "persisted", "value": blank_envelope(output["value"])}})
    offload = offload_of(part)
    masked = _masked_offload(offload, output) if offload is not None else None
    if masked is None or masked == output:
        return None
    return {**part, "output": masked}
