"""`ctx.truncate.step`: plan (pure) → put the texts to the blob store (I/O) → apply (pure)."""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from ctxbuild_codec import inflight_threshold
from ctxbuild_platform import telemetry

from .adapters.blobstore import BlobStore
from .domain import PutResult, apply_step, plan_step

log = structlog.get_logger("truncation")


async def truncate_step(payload: dict[str, Any], blobs: BlobStore) -> dict[str, Any]:
    settings = payload.get("settings") or {}
    threshold = inflight_threshold(settings.get("truncateThreshold"), settings.get("contextWindow"),
                                   settings.get("reservation"))
    parts = payload["parts"]
    jobs = plan_step(parts, threshold)
    puts: dict[int, PutResult | None] = {}
    if jobs:
        with telemetry.span("truncate.offload", **{"ctx.jobs": len(jobs)}):
            # one put per distinct text (same bytes → same blob, same reference)
            by_sha: dict[str, str] = {}
            for job in jobs:
                by_sha.setdefault(job.sha256, job.text)
            shas = list(by_sha)
            results = await asyncio.gather(*(
                blobs.put_provisional(by_sha[s], payload["conversationId"], payload["turnId"]) for s in shas))
            stored = dict(zip(shas, results, strict=True))
            puts = {job.index: stored[job.sha256] for job in jobs}
    result = apply_step(parts, threshold, jobs, puts)
    if result.trimmed:
        log.info("step-trimmed", conversation_id=payload["conversationId"], turn_id=payload["turnId"],
                 threshold=threshold, trimmed=[(t["toolCallId"], t["mode"], t["totalChars"]) for t in result.trimmed])
    return {"parts": result.parts, "threshold": threshold, "trimmed": result.trimmed}
