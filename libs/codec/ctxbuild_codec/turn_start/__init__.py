"""Turn-start planning (SPEC §8), pure: the window read from persistence → what to serve, or what to fold.

The compaction service plans, folds and finishes with it; the turn runner plans with the same code and serves a
plan without a fold itself (no compaction call), calling `ctx.compact.turn_start` only when a fold is needed.
"""

from .context import (
    Retained,
    after_clear,
    attachment_handles,
    max_messages_window,
    persisted_uris,
    retained_context,
)
from .estimate import estimate_tokens
from .fold import FoldOutcome, FoldRequest
from .pages import created_window, merge_pages, read_window
from .plan import (
    PHASE,
    Plan,
    TurnStartSettings,
    decision_time,
    finish,
    keep_start,
    plan_turn_start,
    render_served,
    splits_tool_pair,
    summary_max_chars,
)
from .summary_row import (
    CONTINUE,
    PREAMBLE,
    is_summary_row,
    split_stored,
    stored_summary_row,
    stored_text,
    summary_of_row,
    summary_row,
    summary_row_id,
    summary_row_text,
)

__all__ = [
    "CONTINUE", "PHASE", "PREAMBLE", "FoldOutcome", "FoldRequest", "Plan", "Retained", "TurnStartSettings",
    "after_clear", "attachment_handles", "created_window", "decision_time", "estimate_tokens", "finish",
    "is_summary_row", "keep_start", "max_messages_window", "merge_pages", "persisted_uris", "plan_turn_start",
    "read_window", "render_served", "retained_context", "split_stored", "splits_tool_pair", "stored_summary_row",
    "stored_text", "summary_max_chars", "summary_of_row", "summary_row", "summary_row_id", "summary_row_text",
]
