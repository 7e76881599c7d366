"""Turn-start (durable) compaction, SPEC §8, as two pure steps around the summarizer:

:func:`plan_turn_start` (history + settings → what to serve, or what to fold) and :func:`finish` (the summary
→ what to serve). The handler calls the summarizer in between, so an LLM summarizer (I/O) slots in later
without touching this module.

Shared by the compaction service (which folds) and the turn runner (which serves a plan without a fold itself,
so a turn with nothing to fold makes no compaction call): both plan with this one code.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from .. import envelopes
from ..budgets import CompactionBudget, compaction_budget
from ..tokens import count_message, count_messages
from .context import (
    Retained,
    after_clear,
    attachment_handles,
    max_messages_window,
    retained_context,
)
from .estimate import estimate_tokens
from .fold import FoldOutcome, FoldRequest
from .summary_row import (
    row_text,
    split_opening,
    split_stored,
    stored_summary_row,
    stored_text,
    summary_row,
    trailer_refs,
    transcripts_of,
    with_opening,
)

Message = dict[str, Any]
PHASE = "turn-start"


def decision_time() -> str:
    """A decision's ``startedAt``/``completedAt`` (UTC, milliseconds), whoever plans it."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
OPENING_STORED_MAX_BYTES = 32 * 1024   # leaves the CompactionSummaryRecorded event room under 64 KiB


@dataclass(frozen=True, slots=True)
class TurnStartSettings:
    context_window: float | None = None
    reservation: int | None = None
    compress_enabled: bool = True
    max_messages: int | None = None

    @classmethod
    def from_payload(cls, settings: Mapping[str, Any] | None) -> TurnStartSettings:
        s = settings or {}
        return cls(s.get("contextWindow"), s.get("reservation"), bool(s.get("compressEnabled", True)),
                   s.get("maxMessages"))


@dataclass(frozen=True, slots=True)
class Plan:
    messages: list[Message]            # what to serve (the effective history until a summary is produced)
    retained: Retained
    decision: dict[str, Any]
    fold: FoldRequest | None = None    # set → call a summarizer, then finish()
    kept: list[Message] = field(default_factory=list)
    summary_handles: list[str] = field(default_factory=list)
    summary_transcripts: list[str] = field(default_factory=list)   # of the earlier folds (this one's: finish)
    head: list[Message] = field(default_factory=list)   # served before the folded rows (the previous summary row)
    summary_text: str | None = None    # what to store (CompactionSummaryRecorded.summary) once a summary is made
    opening: str | None = None         # the conversation's first request, when this fold takes it away

    def reply(self) -> dict[str, Any]:
        return {"messages": render_served(self.messages), "retained": self.retained.to_payload(),
                "decision": self.decision}


def render_served(rows: Sequence[Message]) -> list[Message]:
    """Persisted envelopes (SPEC §7) rendered to exactly the bytes the in-flight lane served, with typed
    ``offload`` provenance (the codec's ``render_part``); every other row is returned as it is."""
    out: list[Message] = []
    for row in rows:
        parts = row.get("parts") or []
        if not any((p.get("output") or {}).get("type") == "persisted" for p in parts):
            out.append(row)
            continue
        new_parts = []
        for p in parts:
            try:
                new_parts.append(envelopes.render_part(p))
            except envelopes.EnvelopeError:
                new_parts.append(p)   # not a valid envelope: served as stored, never an exception
        out.append({**row, "parts": new_parts})
    return out


def summary_max_chars(budget: CompactionBudget) -> int:
    """About a tenth of the input room, between 200 and 2,000 tokens (≈ 4 chars a token)."""
    return 4 * min(2_000, max(200, budget.input_room // 10))


def deepest_summary(rows: Sequence[Message]) -> int | None:
    for i in range(len(rows) - 1, -1, -1):
        if rows[i].get("compactionSummary"):
            return i
    return None


def splits_tool_pair(rows: Sequence[Message], start: int) -> bool:
    """Would keeping ``rows[start:]`` separate a tool call from its result (in either direction)?

    Pairs by position, not by id sets: a call's result is the next result with its id. Ids are only unique
    within a turn (replays, and some OpenAI-compatible servers, reuse ``call_1_1`` in every turn), so comparing
    the id sets of the two sides would see a split wherever an id recurs and walk the cut back to the start."""
    pending: Counter[str] = Counter()
    for r in rows[:start]:
        for p in r.get("parts") or []:
            if p.get("type") == "tool-call":
                pending[p.get("toolCallId")] += 1
            elif p.get("type") == "tool-result" and pending[p.get("toolCallId")] > 0:
                pending[p.get("toolCallId")] -= 1
    pending = +pending  # calls before the cut still waiting for their result
    for r in rows[start:]:
        if not pending:
            return False
        for p in r.get("parts") or []:
            cid = p.get("toolCallId")
            if p.get("type") == "tool-result" and pending[cid] > 0:
                return True
            if p.get("type") == "tool-call" and cid in pending:
                del pending[cid]  # the id starts over: the earlier call's result never came (an orphan)
    return False


def keep_start(rows: Sequence[Message], keep_budget: int) -> int | None:
    """Index of the first kept row (SPEC §8.7); None when there is no user row to keep from.

    Walk back from the newest row accumulating tokens until the keep budget is exceeded; keep from the earliest
    user row that still fit (none fit → the last user row), moved further back while it would split a tool call
    from its result.
    """
    acc, candidate = 0, None
    for i in range(len(rows) - 1, -1, -1):
        acc += count_message(rows[i])
        if acc > keep_budget:
            break
        if rows[i].get("role") == "user":
            candidate = i
    users = [i for i, r in enumerate(rows) if r.get("role") == "user"]
    if candidate is None:
        if not users:
            return None
        candidate = users[-1]
    while candidate > 0 and splits_tool_pair(rows, candidate):
        earlier = [i for i in users if i < candidate]
        candidate = earlier[-1] if earlier else 0
    return candidate


def plan_turn_start(history: Mapping[str, Any], settings: TurnStartSettings) -> Plan:
    raw = list(history.get("messages") or [])
    attachments = list(history.get("attachments") or [])

    # the history may be a window (persistence's turn-start read): it begins at the deepest boundary, a
    # clear-context marker or the maxMessages limit instead of the root; what the older rows retained comes from
    # the boundary's stored summary (its trailer), and a marker older than the boundary still restricts
    start_of_window = history.get("start") or "root"

    # 1. clear context
    rows, cut = after_clear(raw)
    cut = cut or bool(history.get("clearedBefore"))

    # 3./4. effective history: the maxMessages window (summaries ignored) or [summary row, rows after it]
    previous: str | None = None
    has_summary_row = False
    if settings.max_messages:
        scope = max_messages_window(rows, settings.max_messages)
        restrict = cut or len(scope) < len(rows) or start_of_window == "limit"
        effective = list(scope)
    else:
        scope, restrict = rows, cut
        d = deepest_summary(rows)
        if d is None:
            effective = list(rows)
        else:
            stored = rows[d]["compactionSummary"]
            previous = split_stored(stored)[0]
            upto = rows[: d + 1]
            effective = [stored_summary_row(rows[d]["id"], stored, attachment_handles(upto)), *rows[d + 1:]]
            has_summary_row = True

    # 2. retained context from the raw rows in scope, never from what is served (finding #2)
    retained = retained_context(scope, attachments, restrict)
    before_handles, before_uris = [], []
    if has_summary_row and start_of_window == "summary" and d == 0:
        before_handles, before_uris = trailer_refs(rows[0]["compactionSummary"])
        retained = with_earlier(retained, attachments, before_handles, before_uris, restrict)
    # the transcripts the summaries in scope name stay readable (SPEC §15.2), however many turns later
    named = [u for r in scope if r.get("compactionSummary") for u in transcripts_of(r["compactionSummary"])]
    if named:
        retained = Retained(retained.file_attachments, list(dict.fromkeys([*retained.persisted_uris, *named])))

    # 5./6. decide
    estimated = estimate_tokens(effective)
    decision: dict[str, Any] = {"status": "serve", "phase": PHASE, "estimatedTokens": estimated}
    budget = compaction_budget(settings.context_window, settings.reservation)
    if budget is not None:
        decision.update(trigger=budget.trigger, keepBudget=budget.keep)
    if not settings.compress_enabled:
        return Plan(effective, retained, {**decision, "reason": "compaction-disabled"})
    if budget is None:
        return Plan(effective, retained, {**decision, "reason": "window-unknown"})
    if estimated <= budget.trigger:
        return Plan(effective, retained, {**decision, "reason": "under-trigger"})

    # 7. keep boundary
    start = keep_start(effective, budget.keep)
    first_real = 1 if has_summary_row else 0
    if start is None or start <= first_real:
        reason = "no-user-row" if start is None else "nothing-to-fold"
        return Plan(effective, retained, {**decision, "status": "skipped", "reason": reason})
    folded = effective[first_real:start]
    boundary_id = str(effective[start - 1]["id"])
    upto = next((scope[: i + 1] for i, r in enumerate(scope) if r.get("id") == boundary_id), scope)

    # the conversation's first request (a multi-turn session's task) stays verbatim in the row that folds it:
    # carried over from the previous summary, or taken from the first user row when this fold is the first
    opening, previous = split_opening(previous)
    if opening is None and not has_summary_row and start_of_window != "limit" and not settings.max_messages:
        first_user = next((r for r in folded if r.get("role") == "user"), None)
        if first_user is not None and first_user is next((r for r in effective if r.get("role") == "user"), None):
            opening = row_text(first_user) or None
    if opening is not None and len(opening.encode()) > OPENING_STORED_MAX_BYTES:
        # the stored summary is one event (≤ 64 KiB, its text inline): a first request this large is not carried
        # by the row — it stays whole in this fold's transcript, one fs_read away
        opening = None

    # 8. what to summarize
    fold = FoldRequest(previous, folded, summary_max_chars(budget), conversation_id=str(history.get(
        "conversationId") or ""), phase=PHASE)
    return Plan(effective, retained,
                {**decision, "status": "skipped", "reason": "summary-pending", "boundaryId": boundary_id,
                 "foldedCount": len(folded)},
                fold=fold, kept=list(effective[start:]),
                summary_handles=list(dict.fromkeys([*(a["handle"] for a in retained.file_attachments),
                                                    *before_handles, *attachment_handles(upto)])),
                summary_transcripts=transcripts_of(rows[d]["compactionSummary"]) if has_summary_row else [],
                head=list(effective[:first_real]), opening=opening)


def with_earlier(retained: Retained, attachments: Sequence[Mapping[str, Any]], handles: Sequence[str],
                 uris: Sequence[str], restrict: bool) -> Retained:
    """The retained context of a window that begins at a stored summary, plus what the rows before the boundary
    retained (named by the summary's trailer): their archived URIs first, in order, and — when a clear-context
    marker restricts the attachments to the referenced ones — the attachments the trailer names."""
    files = list(retained.file_attachments)
    if restrict:
        have = {a["handle"] for a in files}
        named = set(handles)
        for a in attachments:
            if a.get("handle") in named and a["handle"] not in have:
                have.add(a["handle"])
                files.append({"sha256": a["sha256"], "handle": a["handle"],
                              "displayName": a.get("displayName", a["handle"])})
    return Retained(files, list(dict.fromkeys([*uris, *retained.persisted_uris])))


def finish(plan: Plan, outcome: FoldOutcome | str | None, *, error: str | None = None,
           transcript: str | None = None) -> Plan:
    """Apply the summarizer's outcome (a text summary, or masked rows). ``transcript``: the URI of this fold's
    archived transcript — the row names it after the earlier folds' ones, and it joins the retained context.

    Empty summary or an error → ``skipped``, the effective history is served (SPEC §8.8). A masking outcome
    that stands in for a failed summarizer serves the masked rows and still reports ``skipped`` (+ ``fallback``).
    """
    if plan.fold is None:
        return plan
    if isinstance(outcome, str) or outcome is None:
        outcome = FoldOutcome("custom", summary=outcome, error=error)
    decision = {**plan.decision, "summarizer": outcome.summarizer, "summarizerCalls": outcome.calls,
                "summarizerInputTokens": outcome.input_tokens}
    if outcome.empty:
        decision.update(status="skipped", reason="summarizer-error" if outcome.error is not None else "empty-summary")
        if outcome.error:
            decision["error"] = outcome.error[:300]
        return replace(plan, decision=decision, fold=None)
    if outcome.rows is not None:
        served = [*plan.head, *outcome.rows, *plan.kept]
    else:
        transcripts = list(dict.fromkeys([*plan.summary_transcripts, *([transcript] if transcript else [])]))
        text = with_opening(outcome.summary or "", plan.opening)
        row = summary_row(plan.decision["boundaryId"], text, plan.summary_handles, transcripts)
        served = [row, *plan.kept]
        retained = Retained(plan.retained.file_attachments,
                            list(dict.fromkeys([*plan.retained.persisted_uris, *transcripts])))
        plan = replace(plan, retained=retained,
                       summary_text=stored_text(text, plan.summary_handles, transcripts))
    decision.update(status="skipped" if outcome.fallback_from else "compacted",
                    reason="summarizer-error" if outcome.fallback_from else "over-trigger",
                    postTokens=count_messages(served))
    if outcome.fallback_from:
        decision.update(fallback=outcome.summarizer, failedSummarizer=outcome.fallback_from)
        if outcome.error:
            decision["error"] = outcome.error[:300]
    return replace(plan, messages=served, decision=decision, fold=None)
