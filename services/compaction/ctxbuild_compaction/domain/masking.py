"""The ``masking`` summarizer's pure halves (SPEC §10): old tool outputs become their markers, nothing else
changes (no LLM). Restorable: every masked output names a blob that stays readable with fs_read.

- an output ctxbuild already archived (typed provenance: an ``offload`` naming its blobs, or a ``persisted``
  envelope) becomes the codec's marker for the same blobs with the preview omitted
  (``ctxbuild_codec.masking.masked_part``, shared with the runner's in-process fallback);
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

from ctxbuild_codec import PERSIST_MIN_CHARS, extract_text, render_marker, sha256_hex, total_lines
from ctxbuild_codec.masking import masked_part

Message = dict[str, Any]
MASK_MIN_CHARS = PERSIST_MIN_CHARS


@dataclass(frozen=True, slots=True)
class ToArchive:
    sha256: str
    text: str


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
            if part.get("type") != "tool-result" or masked_part(part) is not None:
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
                masked = masked_part(part)
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
