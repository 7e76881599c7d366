"""In-loop compaction (SPEC §9), pure: between two steps of one turn, decide what the next request serves.

The memo is a checkpoint ``{consumedCount, compactedPrefix}``: the first ``consumedCount`` messages of the turn
are represented by ``compactedPrefix`` (a summary row, or masked rows after a masking fold). The candidate is
``compactedPrefix + messages[consumedCount:]``.

- candidate ≤ trigger → served as is, **zero** summarizer calls;
- over → the tail is cut into atomic groups (:mod:`.grouping`), the newest groups that fit the keep budget are
  kept (at least one), and only the older groups of the tail — the increment — are folded, together with the
  previous summary (summary of summary). The summarizer input is O(increment), never the history (finding #4).

Pinned, never folded (SPEC §15.2): system rows and the turn's task — the newest user row (not a summary row)
before the turn's own first row, i.e. the message that started the turn. Once folded past, the task sits right after
the system rows of the compacted prefix, verbatim, before the summary row: ``[system…, task, summary, kept…]``, so
its position and bytes never change from one fold to the next. A masking fold keeps it where it was (masking
never touches a user row).

Every text fold names its transcript (the folded increment archived in full, :mod:`.transcript`) in the summary
row, after the transcripts of the earlier folds: the caller archives it and passes the URI to
:func:`finish_in_loop`.

The checkpoint is made durable by the caller (an ``InLoopFoldRecorded`` event on the turn stream), so a turn
resumed elsewhere reads it back and does not refold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ctxbuild_codec import compaction_budget
from ctxbuild_codec.records import usage_of, usage_tokens
from ctxbuild_codec.tokens import count_message, count_messages
from ctxbuild_codec.turn_start import FoldOutcome, FoldRequest, attachment_handles, summary_max_chars
from ctxbuild_codec.turn_start.summary_row import (
    is_summary_row,
    opening_of_rows,
    row_text,
    row_transcripts,
    split_opening,
    summary_of_row,
    summary_row,
    with_opening,
)

from .grouping import group_rows

Message = dict[str, Any]
PHASE = "in-loop"


class CheckpointMismatch(ValueError):
    """The messages sent do not line up with the checkpoint (they start after its consumedCount)."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    consumed_count: int = 0
    compacted_prefix: list[Message] = field(default_factory=list)
    message_count: int = 0     # messages when it was made: usage of a later assistant row covers the prefix
    folds: int = 0
    handles: list[str] = field(default_factory=list)   # attachments named by the summary row
    transcripts: list[str] = field(default_factory=list)   # named by the prefix's summary row, oldest first
    summarizer: str | None = None
    step: int | None = None
    task_id: str | None = None   # the pinned task: in the compacted prefix once a fold went past it

    @classmethod
    def from_payload(cls, data: Mapping[str, Any] | None) -> Checkpoint:
        if not data:
            return cls()
        prefix = data.get("compactedPrefix") or []
        return cls(int(data.get("consumedCount", 0)), list(prefix),
                   int(data.get("messageCount", data.get("consumedCount", 0))), int(data.get("folds", 0)),
                   list(data.get("handles") or []), row_transcripts(prefix) if isinstance(prefix, list) else [],
                   data.get("summarizer"), data.get("step"), data.get("taskId"))

    def to_payload(self) -> dict[str, Any]:
        # no transcript list: the summary row in the prefix names them (read back by from_payload), so the
        # recorded checkpoint does not grow with every fold of a long turn
        out: dict[str, Any] = {"consumedCount": self.consumed_count, "compactedPrefix": self.compacted_prefix,
                               "messageCount": self.message_count, "folds": self.folds, "handles": self.handles}
        if self.summarizer:
            out["summarizer"] = self.summarizer
        if self.step is not None:
            out["step"] = self.step
        if self.task_id is not None:
            out["taskId"] = self.task_id
        return out


@dataclass(frozen=True, slots=True)
class InLoopSettings:
    context_window: float | None = None
    reservation: int | None = None
    compress_enabled: bool = True
    fixed_tokens: int = 0          # system prompt + tool definitions: part of every request

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> InLoopSettings:
        s = payload.get("settings") or {}
        return cls(s.get("contextWindow"), s.get("reservation"), bool(s.get("compressEnabled", True)),
                   int(payload.get("fixedTokens") or 0))


@dataclass(frozen=True, slots=True)
class InLoopPlan:
    served: list[Message]
    checkpoint: Checkpoint
    decision: dict[str, Any]
    fold: FoldRequest | None = None
    # set when folding
    kept: list[Message] = field(default_factory=list)
    pinned: list[Message] = field(default_factory=list)
    new_consumed: int = 0
    total: int = 0
    boundary_id: str | None = None
    handles: list[str] = field(default_factory=list)
    transcripts: list[str] = field(default_factory=list)   # of the earlier folds (this fold's is added by finish)
    step: int | None = None
    fixed_tokens: int = 0
    task: Message | None = None     # the pinned task row (when a fold went or goes past it)
    task_at: int | None = None      # its index among this fold's rows (newly folded past): masking puts it back
    opening: str | None = None      # the conversation's first request, kept verbatim by the summary row

    def reply(self, changed: bool = False) -> dict[str, Any]:
        return {"messages": self.served, "checkpoint": self.checkpoint.to_payload(), "checkpointChanged": changed,
                "decision": self.decision}


def _union(*lists: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(x for xs in lists for x in xs))


def estimate_candidate(tail: Sequence[Message], candidate: Sequence[Message], ck: Checkpoint, turn_id: str | None,
                       fixed_tokens: int) -> tuple[int, str]:
    """(tokens, how): the newest assistant row of this turn served after the checkpoint was made reports the
    real size of its request — trust it and estimate the rows after it (SPEC §2.4); else count everything.

    The estimate never falls below the shared tokenizer's count of the candidate: a usage that covers a shorter
    request than the candidate (served from a checkpoint the caller no longer holds, e.g. a resumed turn whose
    checkpoint could not be read back) must not let an oversized request through."""
    counted = fixed_tokens + count_messages(list(candidate))
    for i in range(len(tail) - 1, -1, -1):
        row = tail[i]
        usage = usage_of(row)
        if usage and (turn_id is None or row.get("turnId") == turn_id) and ck.consumed_count + i >= ck.message_count:
            by_usage = usage_tokens(usage) + count_messages(list(tail[i + 1:]))
            return (by_usage, "usage") if by_usage >= counted else (counted, "count")
    return counted, "count"


def plan_in_loop(messages: Sequence[Message], offset: int, ck: Checkpoint, settings: InLoopSettings, *,
                 turn_id: str | None = None, conversation_id: str = "", step: int | None = None,
                 retained: Mapping[str, Any] | None = None) -> InLoopPlan:
    """``messages`` are the turn's messages from absolute index ``offset`` on (the caller may leave out what the
    checkpoint already consumed)."""
    if offset > ck.consumed_count:
        raise CheckpointMismatch(f"messages start at {offset} but the checkpoint consumed only {ck.consumed_count}")
    tail = list(messages[ck.consumed_count - offset:])
    total = offset + len(messages)
    if ck.consumed_count > total:
        raise CheckpointMismatch(f"the checkpoint consumed {ck.consumed_count} of {total} messages")
    candidate = [*ck.compacted_prefix, *tail]
    estimated, how = estimate_candidate(tail, candidate, ck, turn_id, settings.fixed_tokens)
    decision: dict[str, Any] = {"status": "serve", "phase": PHASE, "estimatedTokens": estimated, "estimate": how,
                                "consumedCount": ck.consumed_count, "folds": ck.folds, "summarizerCalls": 0}
    budget = compaction_budget(settings.context_window, settings.reservation)
    if budget is not None:
        decision.update(trigger=budget.trigger, keepBudget=budget.keep)
    plan = InLoopPlan(candidate, ck, decision, step=step, fixed_tokens=settings.fixed_tokens)
    if not settings.compress_enabled:
        return replace(plan, decision={**decision, "reason": "compaction-disabled"})
    if budget is None:
        return replace(plan, decision={**decision, "reason": "window-unknown"})
    if estimated <= budget.trigger:
        return replace(plan, decision={**decision, "reason": "under-trigger"})

    # over the trigger: keep the newest groups that fit the keep budget (at least one), fold the older ones
    task_id = ck.task_id or find_task(candidate, turn_id)
    pinned_idx, groups = group_rows(tail)
    keep_from, acc = len(groups), 0
    for g in range(len(groups) - 1, -1, -1):
        acc += sum(count_message(tail[i]) for i in groups[g])
        if acc > budget.keep and g < len(groups) - 1:
            break
        keep_from = g
    if keep_from <= 0:
        return replace(plan, decision={**decision, "status": "skipped", "reason": "nothing-to-fold"})
    first_kept = groups[keep_from][0]
    folding = [tail[i] for g in groups[:keep_from] for i in g]
    # the task is pinned: never part of what is folded
    task_at = next((k for k, r in enumerate(folding) if task_id is not None and r.get("id") == task_id), None)
    folded = [r for k, r in enumerate(folding) if k != task_at]
    if not folded:
        return replace(plan, decision={**decision, "status": "skipped", "reason": "nothing-to-fold"})
    pinned = [tail[i] for i in pinned_idx if i < first_kept]
    kept = tail[first_kept:]

    previous = None
    task = folding[task_at] if task_at is not None else None
    prefix_rows: list[Message] = []
    for row in ck.compacted_prefix:
        text = summary_of_row(row)
        if text is not None:
            previous = text
        elif task_id is not None and row.get("id") == task_id:
            task = row   # pinned by an earlier fold: it stays where it is
        elif row.get("role") != "system":
            prefix_rows.append(row)
    # the conversation's first request (a multi-turn session's task): from a summary that carries it (the
    # previous fold's, or a folded turn-start row), else — the first fold of a turn served from the root — the
    # first user row when it is folded now
    opening, previous = split_opening(previous)
    opening = opening or opening_of_rows([*prefix_rows, *folded])
    if opening is None and not ck.compacted_prefix and not any(is_summary_row(r) for r in candidate):
        first_user = next((r for r in candidate if r.get("role") == "user"), None)
        if first_user is not None and any(r is first_user for r in folded):
            opening = row_text(first_user) or None
    ret = retained or {}
    handles = _union(ck.handles, [a["handle"] for a in ret.get("fileAttachments") or []],
                     attachment_handles([*prefix_rows, *folding]))
    transcripts = _union(ck.transcripts, row_transcripts([*prefix_rows, *folded]))
    fold = FoldRequest(previous, folded, summary_max_chars(budget), prefix=prefix_rows,
                       conversation_id=conversation_id, turn_id=turn_id, phase=PHASE)
    boundary = str(folded[-1].get("id"))
    return replace(plan, fold=fold, kept=kept, pinned=pinned, new_consumed=ck.consumed_count + first_kept,
                   total=total, boundary_id=boundary, handles=handles, transcripts=transcripts,
                   task=task, task_at=task_at, opening=opening,
                   decision={**decision, "status": "skipped", "reason": "summary-pending", "boundaryId": boundary,
                             "foldedCount": len(folded), "foldInput": fold_input(fold, ck)})


def find_task(rows: Sequence[Message], turn_id: str | None = None) -> str | None:
    """The id of the turn's task: the newest user row (not a summary row) before the turn's own first row — the
    message that started the turn, even when user rows come later (a harness's notes between steps)."""
    end = next((i for i, r in enumerate(rows) if turn_id is not None and r.get("turnId") == turn_id), len(rows))
    for row in reversed(rows[:end]):
        if row.get("role") == "user" and not is_summary_row(row) and row.get("id") is not None:
            return str(row["id"])
    return None


def fold_input(fold: FoldRequest, ck: Checkpoint) -> dict[str, Any]:
    """What the summarizer is given, by id (finding #4: the previous fold plus the new rows, not the history)."""
    prev = next((r.get("id") for r in reversed(ck.compacted_prefix) if is_summary_row(r)), None)
    return {"previousSummaryId": prev, "prefixIds": [str(r.get("id")) for r in fold.prefix],
            "rowIds": [str(r.get("id")) for r in fold.rows]}


def finish_in_loop(plan: InLoopPlan, outcome: FoldOutcome | None,
                   transcript: str | None = None) -> tuple[InLoopPlan, bool]:
    """Apply a summarizer's outcome → (plan to reply with, whether the checkpoint changed). ``transcript``: the
    URI of this fold's archived transcript (None: not archived — the row names the earlier ones only)."""
    if plan.fold is None:
        return plan, False
    d = {**plan.decision}
    if outcome is None or outcome.empty:
        d.update(status="skipped", reason="summarizer-error" if outcome is None or outcome.error else "empty-summary")
        if outcome is not None and outcome.error:
            d["error"] = outcome.error[:300]
        return replace(plan, fold=None, decision=d), False
    ck = plan.checkpoint
    transcripts = plan.transcripts
    if outcome.rows is not None:   # masking: the earlier prefix stays byte for byte, the increment is masked
        masked = list(outcome.rows)
        if plan.task_at is not None and plan.task is not None:
            masked.insert(plan.task_at, plan.task)   # the task where it was, verbatim
        prefix = [*ck.compacted_prefix, *plan.pinned, *masked]
    else:
        transcripts = _union(transcripts, [transcript] if transcript else [])
        row = summary_row(plan.boundary_id or "", with_opening(outcome.summary or "", plan.opening), plan.handles,
                          transcripts)
        keep_system = [r for r in ck.compacted_prefix if r.get("role") == "system"]
        prefix = [*keep_system, *plan.pinned, *([plan.task] if plan.task is not None else []), row]
    task_id = str(plan.task["id"]) if plan.task is not None else ck.task_id
    new_ck = Checkpoint(plan.new_consumed, prefix, plan.total, ck.folds + 1, plan.handles, transcripts,
                        outcome.summarizer, plan.step, task_id)
    served = [*prefix, *plan.kept]
    d.update(status="skipped" if outcome.fallback_from else "compacted",
             reason="summarizer-error" if outcome.fallback_from else "over-trigger",
             summarizer=outcome.summarizer, consumedCount=new_ck.consumed_count, folds=new_ck.folds,
             postTokens=plan.fixed_tokens + count_messages(served),
             summarizerCalls=outcome.calls, summarizerInputTokens=outcome.input_tokens)
    if outcome.fallback_from:
        d["fallback"] = outcome.summarizer
        d["failedSummarizer"] = outcome.fallback_from
        if outcome.error:
            d["error"] = outcome.error[:300]
    return replace(plan, served=served, checkpoint=new_ck, fold=None, decision=d), True
