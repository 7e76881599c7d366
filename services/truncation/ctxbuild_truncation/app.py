"""The use case of ``ctx.truncate.step``: decode + validate + plan (CPU) → claims streamed back, texts put (I/O) →
apply + validate + encode (CPU).

Each CPU half is a plain function, so the caller decides where it runs (``offload``): on the event loop for a small
request, on the service's CPU threads for a large one (``handlers.StepHandler``). The I/O (blob puts, claim
read-backs) stays on the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog
from ctxbuild_codec import inflight_threshold, vfs_uri
from ctxbuild_platform import contracts, telemetry
from ctxbuild_platform.errors import InvalidPayload, RemoteError, ServiceError

from . import wire
from .domain import (
    Claim,
    ClaimMeter,
    Measured,
    StepPlan,
    apply_step,
    claim_plan,
    parse_claims,
    plan_step,
    written_from,
)

log = structlog.get_logger("truncation")
SUBJECT = "ctx.truncate.step"
REQUEST = contracts.subject_contract(SUBJECT, "request")
REPLY = contracts.subject_contract(SUBJECT, "reply")
T = TypeVar("T")
parse, encode = wire.parse, wire.encode
Offload = Callable[..., Awaitable[Any]]


class TooLarge(ServiceError):
    code = "too-large"


async def _inline(fn: Callable[..., T], *args: Any) -> T:
    return fn(*args)


@dataclass(frozen=True, slots=True)
class Limits:
    put_concurrency: int = 16
    claim_inline_max_bytes: int = 768 * 1024


# ---------------------------------------------------------------- pure halves (run on a CPU thread when large)

def check(payload: Any) -> dict[str, Any]:
    contracts.validate(REQUEST, payload)
    return payload


def decode(raw: bytes) -> dict[str, Any]:
    return check(parse(raw))


def prepare(payload: dict[str, Any]) -> tuple[StepPlan, dict[int, Claim]]:
    settings = payload.get("settings") or {}
    threshold = inflight_threshold(settings.get("truncateThreshold"), settings.get("contextWindow"),
                                   settings.get("reservation"))
    claims = parse_claims(payload)
    return plan_step(payload["parts"], threshold, claims.keys()), claims


def finish(payload: dict[str, Any], plan: StepPlan, written: dict[str, str | None]) -> dict[str, Any]:
    result = apply_step(payload["parts"], plan, written)
    if result.trimmed:
        log.info("step-trimmed", conversation_id=payload["conversationId"], turn_id=payload["turnId"],
                 threshold=plan.threshold,
                 trimmed=[(t["toolCallId"], t["key"], t["mode"], t["totalChars"]) for t in result.trimmed])
    return {"parts": result.parts, "threshold": plan.threshold, "trimmed": result.trimmed}


def finish_wire(payload: dict[str, Any], plan: StepPlan, written: dict[str, str | None]) -> bytes:
    reply = finish(payload, plan, written)
    contracts.validate(REPLY, reply)
    return encode({"result": reply})


# ---------------------------------------------------------------- the step

async def run_step(payload: dict[str, Any], store: Any, *, offload: Offload = _inline,
                   limits: Limits = Limits(), claim_slots: asyncio.Semaphore | None = None,
                   encoded: bool = False) -> Any:
    """One validated request → the reply (``encoded``: the wire bytes ``{"result": …}``, reply contract checked)."""
    plan, claims = await offload(prepare, payload)
    conversation_id, turn_id = payload["conversationId"], payload["turnId"]
    written: dict[str, str | None] = {}
    blobs = plan.blobs
    with telemetry.span("truncate.offload", **{"ctx.blobs": len(blobs), "ctx.claims": len(claims)}):
        slots = asyncio.Semaphore(max(1, limits.put_concurrency))

        async def put(b):
            async with slots:
                return await store.put_provisional(b.text, b.sha256, conversation_id, turn_id)

        claim_jobs = [_measure_claim(store, c, conversation_id, turn_id, limits, claim_slots)
                      for c in claims.values()]
        results = await asyncio.gather(asyncio.gather(*(put(b) for b in blobs)), *claim_jobs,
                                       return_exceptions=True)
        puts, measured = results[0], results[1:]
        for r in results:
            if isinstance(r, BaseException):
                raise r
        written = written_from(blobs, puts)
    for claim, m in zip(claims.values(), measured, strict=True):
        part = payload["parts"][claim.part]
        p = claim_plan(part, plan.threshold, claim.sha256, m)
        if p is not None:
            plan.claim_plans[claim.part] = p
            written[claim.sha256] = vfs_uri(claim.sha256)  # already stored; the turn's reference was just added
        elif m.kept is not None:
            plan.claim_texts[claim.part] = m.kept
        else:
            raise TooLarge(f"claimed part {claim.part} needs no trimming at threshold {plan.threshold} but its "
                           f"{m.size} bytes cannot travel in one reply (limit {limits.claim_inline_max_bytes})")
    if encoded:
        return await offload(finish_wire, payload, plan, written)
    return await offload(finish, payload, plan, written)


async def _measure_claim(store: Any, claim: Claim, conversation_id: str, turn_id: str, limits: Limits,
                         slots: asyncio.Semaphore | None) -> Measured:
    """Add the turn's provisional reference and stream the claimed text through the meter (bounded memory)."""
    async def go() -> Measured:
        ref = asyncio.ensure_future(store.ref_provisional(claim.sha256, conversation_id, turn_id))
        meter = ClaimMeter(limits.claim_inline_max_bytes)
        try:
            async with aclosing(store.stream(claim.sha256, conversation_id)) as chunks:
                async for chunk in chunks:
                    meter.feed(chunk)
            await ref
        except RemoteError as exc:
            raise ServiceError(f"claim for part {claim.part}: {exc.message}", code=exc.code,
                               retryable=exc.retryable) from exc
        finally:
            if not ref.done():
                ref.cancel()
            await asyncio.gather(ref, return_exceptions=True)
        m = meter.finish()
        if claim.size is not None and claim.size != m.size:
            raise InvalidPayload(f"claim for part {claim.part}: declared size {claim.size} != stored {m.size}")
        return m

    with telemetry.span("truncate.claim", **{"ctx.part": claim.part, "ctx.sha256": claim.sha256}):
        if slots is None:
            return await go()
        async with slots:
            return await go()


async def truncate_step(payload: dict[str, Any], store: Any, **kw: Any) -> dict[str, Any]:
    """The step for an already-validated request, all on the caller's loop (tests, tools)."""
    return await run_step(payload, store, **kw)
