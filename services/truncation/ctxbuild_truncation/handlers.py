"""`ctx.truncate.step`: plan (pure) → put the texts to the blob store (I/O) → apply (pure)."""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from ctxbuild_codec import inflight_threshold
from ctxbuild_platform import telemetry

from .adapters.blobstore import BlobStore
from .domain import apply_step, plan_step, written_from

log = structlog.get_logger("truncation")


async def truncate_step(payload: dict[str, Any], store: BlobStore) -> dict[str, Any]:
    settings = payload.get("settings") or {}
    threshold = inflight_threshold(settings.get("truncateThreshold"), settings.get("contextWindow"),
                                   settings.get("reservation"))
    parts = payload["parts"]
    plan = plan_step(parts, threshold)
    blobs = plan.blobs
    written: dict[str, str | None] = {}
    if blobs:
        with telemetry.span("truncate.offload", **{"ctx.blobs": len(blobs)}):
            results = await asyncio.gather(*(
                store.put_provisional(b.text, payload["conversationId"], payload["turnId"]) for b in blobs))
            written = written_from(blobs, results)
    result = apply_step(parts, plan, written)
    if result.trimmed:
        log.info("step-trimmed", conversation_id=payload["conversationId"], turn_id=payload["turnId"],
                 threshold=threshold, trimmed=[(t["toolCallId"], t["mode"], t["totalChars"]) for t in result.trimmed])
    return {"parts": result.parts, "threshold": threshold, "trimmed": result.trimmed}
