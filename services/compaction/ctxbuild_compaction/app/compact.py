"""The use cases of `ctx.compact.turn_start` and `ctx.compact.in_loop`: I/O (through ports) around the pure domain.

turn_start: history (I/O) → plan (pure) → summarizer and transcript archive (I/O, concurrently) → finish (pure)
→ store the summary once as a CompactionSummaryRecorded event at its boundary (write once, serve many).
in_loop: checkpoint (from the request, else read back from the turn stream; its compacted prefix resolved when it
comes by reference) → plan (pure) → summarizer (and the transcript archive) only when the candidate is over the
trigger → finish (pure) → a large new prefix stored as a blob of the turn, so the reply names it by reference.
The caller — the turn stream's only writer — records the new checkpoint (InLoopFoldRecorded) and the decision
(CompactionDecided).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import structlog
from ctxbuild_blobclient import content_ref
from ctxbuild_codec.turn_start import decision_time
from ctxbuild_platform import telemetry
from ctxbuild_platform.errors import InvalidPayload, RemoteError

from ..domain import (
    Checkpoint,
    CheckpointMismatch,
    InLoopSettings,
    TurnStartSettings,
    finish,
    finish_in_loop,
    plan_in_loop,
    plan_turn_start,
)
from .summarizers import Choice, Summarizer, Summarizers, as_summarizers, fold_with_fallback

log = structlog.get_logger("compaction")


class HistoryPort(Protocol):
    async def history(self, conversation_id: str, anchor_id: str | None = None, *,
                      max_messages: int | None = None) -> dict[str, Any]: ...

    async def store_summary(self, conversation_id: str, data: dict[str, Any]) -> bool: ...

    async def last_fold(self, turn_id: str) -> dict[str, Any] | None: ...


class ArchivePort(Protocol):  # adapters/blobstore.BlobStore
    async def archive(self, rows: Sequence[dict[str, Any]], conversation_id: str, turn_id: str | None) -> str | None:
        ...


class CheckpointPort(ArchivePort, Protocol):  # adapters/blobstore.BlobStore
    async def resolve_checkpoint(self, checkpoint: dict[str, Any], conversation_id: str) -> dict[str, Any]: ...

    async def checkpoint_by_reference(self, checkpoint: dict[str, Any], conversation_id: str,
                                      turn_id: str) -> dict[str, Any]: ...


async def _fold_and_archive(choice: Choice, fold, archive: ArchivePort | None, conversation_id: str,
                            turn_id: str | None):
    """(outcome, transcript URI | None): the summarizer and the transcript archive run side by side; masking
    (whose rows keep every output's own link) archives nothing."""
    summarize = fold_with_fallback(choice.summarizer, fold, choice.fallback)
    if archive is None or choice.summarizer.name == "masking":
        return await summarize, None
    outcome, uri = await asyncio.gather(summarize, archive.archive(fold.input_rows(), conversation_id, turn_id))
    return outcome, uri


async def turn_start(payload: dict[str, Any], history: HistoryPort,
                     summarizers: Summarizers | Summarizer | None = None, *,
                     archive: ArchivePort | None = None) -> dict[str, Any]:
    conversation_id = payload["conversationId"]
    turn_id = payload.get("turnId")
    started, t0 = decision_time(), time.monotonic()
    pick = as_summarizers(summarizers)
    with telemetry.span("compaction.turn_start", **{"ctx.conversation_id": conversation_id}) as span:
        settings = payload.get("settings") or {}
        # only the window is read: from the deepest boundary (or the maxMessages rows), not the whole history
        hist = await history.history(conversation_id, payload.get("anchorId"),
                                     max_messages=settings.get("maxMessages"))
        plan = plan_turn_start(hist, TurnStartSettings.from_payload(settings))
        extra: dict[str, Any] = {}
        if plan.fold is not None:
            choice = pick.pick(settings)
            if choice.note:
                extra["note"] = choice.note
            outcome, transcript = await _fold_and_archive(choice, replace(plan.fold, turn_id=turn_id), archive,
                                                          conversation_id, turn_id)
            plan = finish(plan, outcome, transcript=transcript)
            if transcript and outcome.rows is None:
                extra["transcript"] = transcript
            if plan.decision["status"] == "compacted" and outcome.summary:
                plan, extra["stored"] = await _store_once(plan, outcome, hist, history, payload)
        d = {**plan.decision, **extra, "startedAt": started, "completedAt": decision_time(),
             "durationMs": int((time.monotonic() - t0) * 1000)}
        plan = replace(plan, decision=d)
        span.set_attribute("ctx.compaction.status", d["status"])
        span.set_attribute("ctx.compaction.estimated_tokens", d["estimatedTokens"])
        log.info("turn-start-decision", conversation_id=conversation_id, status=d["status"], reason=d["reason"],
                 estimated_tokens=d["estimatedTokens"], post_tokens=d.get("postTokens"),
                 folded=d.get("foldedCount"), boundary_id=d.get("boundaryId"), summarizer=d.get("summarizer"))
        return plan.reply()


async def _store_once(plan, outcome, hist, history: HistoryPort, payload: dict[str, Any]):
    """Store the summary as an event at its boundary. When another turn stored one for the same boundary first,
    serve that one (the first summary per boundary wins; byte-stable for every later turn)."""
    cid = payload["conversationId"]
    d = plan.decision
    data = {"boundaryId": d["boundaryId"], "summary": plan.summary_text, "turnId": payload.get("turnId"),
            "foldedCount": d.get("foldedCount"), "summarizer": outcome.summarizer}
    try:
        stored = await history.store_summary(cid, data)
    except RemoteError as exc:
        # served anyway; the next turn folds again (nothing is lost, the summary is just not reused)
        log.warning("summary-not-stored", conversation_id=cid, error=str(exc)[:300])
        return plan, False
    if stored:
        return plan, True
    again = await history.history(cid, payload.get("anchorId"),
                                  max_messages=(payload.get("settings") or {}).get("maxMessages"))
    replan = plan_turn_start(again, TurnStartSettings.from_payload(payload.get("settings")))
    if replan.fold is None and replan.messages and replan.messages[0].get("id") == plan.messages[0].get("id"):
        return replace(plan, messages=replan.messages,
                       decision={**d, "postTokens": replan.decision["estimatedTokens"], "reused": True}), False
    return plan, False


async def in_loop(payload: dict[str, Any], history: HistoryPort,
                  summarizers: Summarizers | Summarizer | None = None, *,
                  checkpoints: CheckpointPort | None = None) -> dict[str, Any]:
    turn_id = payload.get("turnId")
    conversation_id = payload["conversationId"]
    started, t0 = decision_time(), time.monotonic()
    pick = as_summarizers(summarizers)
    with telemetry.span("compaction.in_loop", **{"ctx.turn_id": turn_id or "", "ctx.step": payload.get("step", 0)}) \
            as span:
        raw_ck = payload.get("checkpoint")
        read_back = False
        if "checkpoint" not in payload and turn_id:  # absent (not null): a resumed turn, read it back
            try:
                raw_ck = await history.last_fold(turn_id)
            except RemoteError as exc:  # cannot read it back: start from scratch (folds again, loses nothing)
                log.warning("checkpoint-read-failed", turn_id=turn_id, error=str(exc)[:300])
            read_back = raw_ck is not None
        prefix_ref = (raw_ck or {}).get("compactedPrefix")
        if not content_ref.is_ref(prefix_ref):
            prefix_ref = None
        elif checkpoints is None:
            raise InvalidPayload("the checkpoint's compacted prefix is a content reference and this service has no "
                                 "blob store to resolve it")
        else:
            raw_ck = await checkpoints.resolve_checkpoint(raw_ck, conversation_id)
        ck = Checkpoint.from_payload(raw_ck)
        settings = payload.get("settings") or {}
        try:
            plan = plan_in_loop(payload.get("messages") or [], int(payload.get("offset") or 0), ck,
                                InLoopSettings.from_payload(payload), turn_id=turn_id,
                                conversation_id=conversation_id, step=payload.get("step"),
                                retained=payload.get("retained"))
        except CheckpointMismatch as exc:
            raise InvalidPayload(str(exc)) from exc
        changed = False
        extra: dict[str, Any] = {"checkpointReadBack": read_back}
        if plan.fold is not None:
            choice = pick.pick(settings)
            if choice.note:
                extra["note"] = choice.note
            outcome, transcript = await _fold_and_archive(choice, plan.fold, checkpoints, conversation_id, turn_id)
            planned = plan
            plan, changed = finish_in_loop(plan, outcome, transcript)
            if changed and outcome.rows is not None and plan.decision["postTokens"] > plan.decision["trigger"]:
                # masking alone no longer fits (a long run: the masked calls and answers add up): collapse the
                # masked prefix and the increment into a summary row with the offline summarizer — lossless all
                # the same, the transcript holds every output in full
                collapsed, transcript = await _fold_and_archive(Choice(pick.extractive, None), planned.fold,
                                                                checkpoints, conversation_id, turn_id)
                if not collapsed.empty:
                    collapsed.summarizer = outcome.summarizer
                    collapsed.fallback_from = outcome.fallback_from
                    collapsed.error = outcome.error
                    plan, changed = finish_in_loop(planned, collapsed, transcript)
                    extra["note"] = "; ".join(filter(None, [extra.get("note"), "masking-collapsed"]))
            if transcript and plan.checkpoint.transcripts and plan.checkpoint.transcripts[-1] == transcript:
                extra["transcript"] = transcript
        d = {**plan.decision, **extra, "startedAt": started, "completedAt": decision_time(),
             "durationMs": int((time.monotonic() - t0) * 1000)}
        span.set_attribute("ctx.compaction.status", d["status"])
        if plan.decision["status"] != "serve":
            log.info("in-loop-decision", turn_id=turn_id, step=payload.get("step"), status=d["status"],
                     reason=d["reason"], estimated_tokens=d["estimatedTokens"], post_tokens=d.get("postTokens"),
                     folded=d.get("foldedCount"), summarizer=d.get("summarizer"), fallback=d.get("fallback"))
        reply = replace(plan, decision=d).reply(changed)
        if not changed and prefix_ref is not None:
            reply["checkpoint"]["compactedPrefix"] = prefix_ref  # unchanged: the same reference, nothing rewritten
        elif checkpoints is not None and turn_id:
            reply["checkpoint"] = await checkpoints.checkpoint_by_reference(reply["checkpoint"], conversation_id,
                                                                            turn_id)
        return reply


@dataclass
class Compaction:
    """The service's use cases over its adapters (wired in ``__main__``): what the handlers call."""

    history: HistoryPort
    summarizers: Summarizers | Summarizer | None = None
    blobs: CheckpointPort | None = None

    async def turn_start(self, payload: dict[str, Any]) -> dict[str, Any]:
        return await turn_start(payload, self.history, self.summarizers, archive=self.blobs)

    async def in_loop(self, payload: dict[str, Any]) -> dict[str, Any]:
        return await in_loop(payload, self.history, self.summarizers, checkpoints=self.blobs)
