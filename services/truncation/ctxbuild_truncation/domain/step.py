"""The opaque lane of one step (SPEC §3, §5), split so the handler does the only I/O in between:

1. :func:`plan_step` — which parts need trimming and the full text of each (what to offload);
2. the handler puts each text into the blob store (role ``provisional``, owner = the turn);
3. :func:`apply_step` — each planned part becomes the marker (stored) or the inline excerpt (store failed).

Provenance is typed: a part is "already trimmed" only when it carries ``offload`` or a ``persisted`` output.
Text that merely *looks* like a marker (``<persisted-output>``) is ordinary content and is trimmed like any other.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ctxbuild_codec import excerpt, inline_truncate, needs_trim, render_marker, sha256_hex, total_lines

from .policy import policy_for

ERROR_TYPES = ("error-text", "error-json")


@dataclass(frozen=True, slots=True)
class TrimJob:
    """A part to trim: its index in the step, its full text, whether its output was an error."""

    index: int
    tool_call_id: str
    text: str
    is_error: bool

    @property
    def sha256(self) -> str:
        return sha256_hex(self.text)


@dataclass(frozen=True, slots=True)
class PutResult:
    """What the blob store acknowledged for a job's text."""

    uri: str
    sha256: str


@dataclass(frozen=True, slots=True)
class StepResult:
    parts: list[dict[str, Any]]
    trimmed: list[dict[str, Any]]


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def extract_text(output: Mapping[str, Any]) -> str | None:
    """Opaque-lane text of a tool output; None when the output is not ours to trim (``persisted``, unknown)."""
    kind = output.get("type")
    value = output.get("value")
    if kind in ("text", "error-text"):
        return value if isinstance(value, str) else ""
    if kind in ("json", "error-json"):
        return compact_json(value)
    if kind == "content":
        texts = [b.get("text") for b in (value or []) if isinstance(b, Mapping) and b.get("type") == "text"]
        return "\n".join(t for t in texts if isinstance(t, str) and t)
    return None


def skip_reason(part: Mapping[str, Any]) -> str | None:
    """Why a part is left untouched before looking at its size, or None if it is a candidate."""
    if part.get("type") != "tool-result":
        return "not-a-tool-result"
    if not policy_for(part).truncatable:
        return "not-truncatable"
    if part.get("offload") is not None:
        return "already-offloaded"
    output = part.get("output") or {}
    if output.get("type") == "persisted":
        return "persisted"
    return None


def plan_step(parts: Sequence[Mapping[str, Any]], threshold: int) -> list[TrimJob]:
    jobs: list[TrimJob] = []
    for i, part in enumerate(parts):
        if skip_reason(part) is not None:
            continue
        output = part.get("output") or {}
        text = extract_text(output)
        if text is None or not needs_trim(text, threshold):
            continue
        jobs.append(TrimJob(i, str(part.get("toolCallId", "")), text, output.get("type") in ERROR_TYPES))
    return jobs


def offloaded_output(job: TrimJob, put: PutResult) -> str:
    """The marker with the URI the store acknowledged (== ``marker(text)`` for a well-behaved store)."""
    ex = excerpt(job.text)
    return render_marker(ex.head, ex.tail, ex.total_lines, ex.total_chars, put.uri)


def apply_step(parts: Sequence[Mapping[str, Any]], threshold: int, jobs: Sequence[TrimJob],
               puts: Mapping[int, PutResult | None]) -> StepResult:
    """Replace each planned part's output. ``puts[index]`` is None (or missing) when the store failed.

    A put whose sha256 does not match the text is treated as a failure: a marker must never point at other bytes.
    """
    out: list[dict[str, Any]] = [dict(p) for p in parts]
    trimmed: list[dict[str, Any]] = []
    for job in jobs:
        put = puts.get(job.index)
        if put is not None and put.sha256 != job.sha256:
            put = None
        n_chars, n_lines = len(job.text), total_lines(job.text)
        kind = "error-text" if job.is_error else "text"
        part = out[job.index]
        if put is not None:
            part["output"] = {"type": kind, "value": offloaded_output(job, put)}
            part["offload"] = {"mode": "offloaded", "uri": put.uri, "sha256": put.sha256,
                               "totalChars": n_chars, "totalLines": n_lines, "threshold": threshold}
            trimmed.append({"toolCallId": job.tool_call_id, "mode": "offloaded", "uri": put.uri,
                            "totalChars": n_chars, "totalLines": n_lines})
        else:
            part["output"] = {"type": kind, "value": inline_truncate(job.text)}
            part["offload"] = {"mode": "inline", "totalChars": n_chars, "totalLines": n_lines,
                               "threshold": threshold}
            trimmed.append({"toolCallId": job.tool_call_id, "mode": "inline",
                            "totalChars": n_chars, "totalLines": n_lines})
    return StepResult(out, trimmed)
