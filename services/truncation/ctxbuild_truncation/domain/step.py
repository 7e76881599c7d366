"""One step of the in-flight lane (SPEC §5), split so the handler does the only I/O in between:

1. :func:`plan_step` — per part, the codec library's plan (``ctxbuild_codec.plan_inflight``): what to trim and
   the distinct full texts to offload. Claimed parts (claim check) are planned after their text streamed back
   (:mod:`.claims`);
2. the handler puts each text into the blob store (role ``provisional``, owner = the turn);
3. :func:`apply_step` — each planned part trimmed by ``ctxbuild_codec.apply_inflight`` with what was written;
   a codec offload (entities, text-field) gets ``offload.blobs`` naming every per-field blob; an output with
   non-text parts (SPEC §15.1) names its original in ``offload.original`` (its row in ``trimmed`` says
   ``original: true``).

Policies, codecs, text extraction and the trim primitive all live in ``ctxbuild_codec``; this module only maps
a step's parts over them and shapes the reply.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ctxbuild_codec import BlobToWrite, TrimPlan, apply_inflight, plan_inflight, trim_records


@dataclass(frozen=True, slots=True)
class PutResult:
    """What the blob store acknowledged for a text."""

    uri: str
    sha256: str


@dataclass(slots=True)
class StepPlan:
    threshold: int
    plans: list[TrimPlan | None]  # one per part, None = untouched (or claimed: see claim_plans)
    claimed: frozenset[int] = frozenset()
    claim_plans: dict[int, TrimPlan] = field(default_factory=dict)  # claimed parts that are trimmed
    claim_texts: dict[int, str] = field(default_factory=dict)  # claimed parts served whole

    @property
    def blobs(self) -> list[BlobToWrite]:
        """Distinct texts to put across the step (the same bytes twice → one blob, one reference). Claimed texts
        are already stored and are not among them."""
        seen: dict[str, BlobToWrite] = {}
        for plan in self.plans:
            for b in plan.blobs if plan is not None else ():
                seen.setdefault(b.sha256, b)
        return list(seen.values())


@dataclass(frozen=True, slots=True)
class StepResult:
    parts: list[dict[str, Any]]
    trimmed: list[dict[str, Any]]


def plan_step(parts: Sequence[Mapping[str, Any]], threshold: int, claimed: Collection[int] = ()) -> StepPlan:
    claimed = frozenset(claimed)
    return StepPlan(threshold, [None if i in claimed else plan_inflight(p, threshold) for i, p in enumerate(parts)],
                    claimed)


def written_from(blobs: Sequence[BlobToWrite], puts: Sequence[PutResult | None]) -> dict[str, str | None]:
    """sha256 → acknowledged URI; a failed put, or one acknowledged for other bytes, is None."""
    return {b.sha256: (p.uri if p is not None and p.sha256 == b.sha256 else None)
            for b, p in zip(blobs, puts, strict=True)}


def _with_blobs(out: dict[str, Any], plan: TrimPlan, written: Mapping[str, str | None]) -> dict[str, Any]:
    """A codec offload names each per-field blob (``offload.blobs``): the totals alone cannot say which URIs the
    part's markers point at."""
    offload = out.get("offload")
    if plan.route == "codec" and isinstance(offload, dict) and offload.get("mode") == "offloaded":
        offload["blobs"] = [{"key": r.key, "uri": r.uri, "sha256": r.sha256, "totalChars": r.total_chars,
                             "totalLines": r.total_lines} for r in trim_records(plan, written) if r.mode == "offloaded"]
    return out


def apply_step(parts: Sequence[Mapping[str, Any]], plan: StepPlan, written: Mapping[str, str | None]) -> StepResult:
    out: list[dict[str, Any]] = []
    trimmed: list[dict[str, Any]] = []
    for i, part in enumerate(parts):
        p = plan.plans[i] if i not in plan.claimed else plan.claim_plans.get(i)
        if p is None:
            if i in plan.claim_texts:  # claimed, needs no trimming: the full text, as the tool returned it
                whole = dict(part)
                whole["output"] = {"type": part["output"]["type"], "value": plan.claim_texts[i]}
                out.append(whole)
            else:
                out.append(dict(part))
            continue
        out.append(_with_blobs(apply_inflight(part, p, written), p, written))
        call_id = str(part.get("toolCallId", ""))
        for r in trim_records(p, written):
            row: dict[str, Any] = {"toolCallId": call_id, "mode": r.mode, "key": r.key}
            if r.uri:
                row["uri"] = r.uri
                row["sha256"] = r.sha256
            if r.original:
                row["original"] = True
            if i in plan.claimed:
                row["claim"] = True
            row["totalChars"] = r.total_chars
            row["totalLines"] = r.total_lines
            trimmed.append(row)
    return StepResult(out, trimmed)
