"""One step of the in-flight lane (SPEC §5), split so the handler does the only I/O in between:

1. :func:`plan_step` — per part, the codec library's plan (``ctxbuild_codec.plan_inflight``): what to trim and
   the distinct full texts to offload;
2. the handler puts each text into the blob store (role ``provisional``, owner = the turn);
3. :func:`apply_step` — each planned part trimmed by ``ctxbuild_codec.apply_inflight`` with what was written.

Policies, codecs, text extraction and the trim primitive all live in ``ctxbuild_codec``; this module only maps
a step's parts over them and shapes the reply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ctxbuild_codec import BlobToWrite, TrimPlan, apply_inflight, plan_inflight, records


@dataclass(frozen=True, slots=True)
class PutResult:
    """What the blob store acknowledged for a text."""

    uri: str
    sha256: str


@dataclass(frozen=True, slots=True)
class StepPlan:
    threshold: int
    plans: list[TrimPlan | None]  # one per part, None = untouched

    @property
    def blobs(self) -> list[BlobToWrite]:
        """Distinct texts to put across the step (the same bytes twice → one blob, one reference)."""
        seen: dict[str, BlobToWrite] = {}
        for plan in self.plans:
            for b in plan.blobs if plan is not None else ():
                seen.setdefault(b.sha256, b)
        return list(seen.values())


@dataclass(frozen=True, slots=True)
class StepResult:
    parts: list[dict[str, Any]]
    trimmed: list[dict[str, Any]]


def plan_step(parts: Sequence[Mapping[str, Any]], threshold: int) -> StepPlan:
    return StepPlan(threshold, [plan_inflight(p, threshold) for p in parts])


def written_from(blobs: Sequence[BlobToWrite], puts: Sequence[PutResult | None]) -> dict[str, str | None]:
    """sha256 → acknowledged URI; a failed put, or one acknowledged for other bytes, is None."""
    return {b.sha256: (p.uri if p is not None and p.sha256 == b.sha256 else None)
            for b, p in zip(blobs, puts, strict=True)}


def apply_step(parts: Sequence[Mapping[str, Any]], plan: StepPlan, written: Mapping[str, str | None]) -> StepResult:
    out: list[dict[str, Any]] = []
    trimmed: list[dict[str, Any]] = []
    for part, p in zip(parts, plan.plans, strict=True):
        if p is None:
            out.append(dict(part))
            continue
        out.append(apply_inflight(part, p, written))
        call_id = str(part.get("toolCallId", ""))
        for r in records(p, written):
            trimmed.append({"toolCallId": call_id, "mode": r.mode, **({"uri": r.uri} if r.uri else {}),
                            "totalChars": r.total_chars, "totalLines": r.total_lines})
    return StepResult(out, trimmed)
