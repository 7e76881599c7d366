"""`ctx.compact.turn_start`: history (I/O) → plan (pure) → summarizer → finish (pure)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import structlog
from ctxbuild_platform import telemetry

from .domain import FoldRequest, TurnStartSettings, extractive_summary, finish, plan_turn_start

log = structlog.get_logger("compaction")

Summarizer = Callable[[FoldRequest], str]


class HistoryPort(Protocol):
    async def history(self, conversation_id: str, anchor_id: str | None = None) -> dict[str, Any]: ...


def extractive(fold: FoldRequest) -> str:
    return extractive_summary(fold.previous_summary, fold.rows, fold.max_chars)


async def turn_start(payload: dict[str, Any], history: HistoryPort,
                     summarizer: Summarizer = extractive) -> dict[str, Any]:
    conversation_id = payload["conversationId"]
    with telemetry.span("compaction.turn_start", **{"ctx.conversation_id": conversation_id}) as span:
        hist = await history.history(conversation_id, payload.get("anchorId"))
        plan = plan_turn_start(hist, TurnStartSettings.from_payload(payload.get("settings")))
        if plan.fold is not None:
            try:
                summary = summarizer(plan.fold)
            except Exception as exc:  # noqa: BLE001 - a summarizer failure never fails the turn: serve as is
                log.warning("summarizer-failed", conversation_id=conversation_id, error=repr(exc)[:300])
                plan = finish(plan, None, error=repr(exc))
            else:
                plan = finish(plan, summary)
        d = plan.decision
        span.set_attribute("ctx.compaction.status", d["status"])
        span.set_attribute("ctx.compaction.estimated_tokens", d["estimatedTokens"])
        log.info("turn-start-decision", conversation_id=conversation_id, status=d["status"], reason=d["reason"],
                 estimated_tokens=d["estimatedTokens"], post_tokens=d.get("postTokens"),
                 folded=d.get("foldedCount"), boundary_id=d.get("boundaryId"))
        return plan.reply()
