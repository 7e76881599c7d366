"""The ``masking`` summarizer's pure halves (SPEC §10): old tool outputs become their markers, nothing else
changes (no LLM). Restorable: every masked output names a blob that stays readable with fs_read.

- an output ctxbuild already archived (typed provenance: ``offload`` with a URI, or a ``persisted`` envelope)
  becomes the codec's marker for the same blob with the preview omitted;
- any other text output longer than :data:`MASK_MIN_CHARS` is archived first (the caller puts the text in the
  blob store) and then masked; a failed put keeps the output in full ("better fat than lost");
- error outputs and small outputs stay as they are; tool calls and the pairing with their results never change.

Same planner/applier split as the codec lanes: :func:`plan_masking` lists the texts to archive,
:func:`apply_masking` takes ``{sha256: uri | None}`` and returns the rows. Both are pure functions of their
inputs, so a masked row always renders to the same bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ctxbuild_codec import PERSIST_MIN_CHARS, assemble, extract_text, render_marker, sha256_hex, total_lines
from ctxbuild_codec.envelopes import EnvelopeError, parse, render_part
from ctxbuild_codec.nontext import render_with_markers

Message = dict[str, Any]
MASK_MIN_CHARS = PERSIST_MIN_CHARS


@dataclass(frozen=True, slots=True)
class ToArchive:
    sha256: str
    text: str


def _blank_envelope(envelope: Mapping[str, Any]) -> dict[str, Any]:
    if "blobRefs" in envelope:
        return {**envelope, "blobRefs": [{**r, "head": "", "tail": ""} for r in envelope["blobRefs"]]}
    return {**envelope, "head": "", "tail": ""}


def _masked_offloaded(part: Mapping[str, Any]) -> dict[str, Any] | None:
    """An output ctxbuild archived → the same part with a preview-less marker; None if it is not one."""
    output = part.get("output") or {}
    if output.get("type") == "persisted" and isinstance(output.get("value"), Mapping):
        try:
            parse(output["value"])
        except EnvelopeError:
            return None
        return render_part({**part, "output": {"type": "persisted", "value": _blank_envelope(output["value"])}})
    off = part.get("offload") or {}
    if off.get("mode") != "offloaded":
        return None
    if off.get("uri"):
        kind = output.get("type") if output.get("type") in ("text", "error-text") else "text"
        value = render_marker("", "", int(off.get("totalLines", 1)), int(off.get("totalChars", 0)), off["uri"])
        original = off.get("original")
        if isinstance(original, Mapping) and original.get("of") == "output":  # non-text parts keep their markers
            value = render_with_markers(value, original.get("parts") or [], original.get("uri"))
        return {**part, "output": {"type": kind, "value": value}}
    blobs = off.get("blobs") or []
    if blobs and output.get("type") == "json":
        texts = {b["key"]: render_marker("", "", int(b["totalLines"]), int(b["totalChars"]), b["uri"])
                 for b in blobs if b.get("uri")}
        return {**part, "output": {"type": "json", "value": assemble(output.get("value"), texts)}}
    return None


def _maskable_text(part: Mapping[str, Any]) -> str | None:
    output = part.get("output") or {}
    if str(output.get("type", "")).startswith("error") or part.get("offload"):
        return None
    text = extract_text(output)
    return text if text is not None and len(text) > MASK_MIN_CHARS else None


def plan_masking(rows: Sequence[Message]) -> list[ToArchive]:
    """Texts that must be archived before their outputs can be masked (deduplicated by sha256)."""
    out: dict[str, ToArchive] = {}
    for row in rows:
        for part in row.get("parts") or []:
            if part.get("type") != "tool-result" or _masked_offloaded(part) is not None:
                continue
            text = _maskable_text(part)
            if text is not None:
                sha = sha256_hex(text)
                out.setdefault(sha, ToArchive(sha, text))
    return list(out.values())


def apply_masking(rows: Sequence[Message], written: Mapping[str, str | None]) -> list[Message]:
    """The rows with every maskable output masked; ``written[sha256]`` is the archived URI (None: write failed,
    the output stays). Unchanged rows are returned as the same objects."""
    result: list[Message] = []
    for row in rows:
        parts = row.get("parts") or []
        new_parts = []
        changed = False
        for part in parts:
            new = part
            if part.get("type") == "tool-result":
                masked = _masked_offloaded(part)
                if masked is not None:
                    new = masked
                else:
                    text = _maskable_text(part)
                    uri = written.get(sha256_hex(text)) if text is not None else None
                    if text is not None and uri:
                        kind = "text"
                        value = render_marker("", "", total_lines(text), len(text), uri)
                        new = {**part, "output": {"type": kind, "value": value},
                               "offload": {"mode": "offloaded", "uri": uri, "sha256": sha256_hex(text),
                                           "totalChars": len(text), "totalLines": total_lines(text)}}
            changed = changed or new is not part
            new_parts.append(new)
        result.append({**row, "parts": new_parts} if changed else row)
    return result
