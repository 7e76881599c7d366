"""Pure logic of compaction (SPEC §8–§10): no I/O, unit-tested. Turn-start planning (and the summary row, retained
context, estimate and fold types it uses) lives in the shared codec (``ctxbuild_codec.turn_start``), where the turn
runner plans with the same code; its names are re-exported here."""

from ctxbuild_codec.turn_start import (
    CONTINUE,
    PREAMBLE,
    FoldOutcome,
    FoldRequest,
    Plan,
    Retained,
    TurnStartSettings,
    after_clear,
    attachment_handles,
    estimate_tokens,
    finish,
    is_summary_row,
    keep_start,
    max_messages_window,
    persisted_uris,
    plan_turn_start,
    render_served,
    retained_context,
    split_stored,
    splits_tool_pair,
    stored_summary_row,
    stored_text,
    summary_max_chars,
    summary_of_row,
    summary_row,
    summary_row_id,
    summary_row_text,
)

from .extractive import RegexTokenizer, extractive_summary, rank
from .grouping import count_groups, group_rows, orphans
from .in_loop import (
    Checkpoint,
    CheckpointMismatch,
    InLoopPlan,
    InLoopSettings,
    estimate_candidate,
    finish_in_loop,
    plan_in_loop,
)
from .llm_input import build_input, flatten, postprocess
from .masking import apply_masking, plan_masking

__all__ = [
    "CONTINUE", "PREAMBLE", "Checkpoint", "CheckpointMismatch", "FoldOutcome", "FoldRequest", "InLoopPlan",
    "InLoopSettings", "Plan", "RegexTokenizer", "Retained", "TurnStartSettings", "after_clear", "apply_masking",
    "attachment_handles", "build_input", "count_groups", "estimate_candidate", "estimate_tokens",
    "extractive_summary", "finish", "finish_in_loop", "flatten", "group_rows", "is_summary_row", "keep_start",
    "max_messages_window", "orphans", "persisted_uris", "plan_in_loop", "plan_masking", "plan_turn_start",
    "postprocess", "rank", "render_served", "retained_context", "split_stored", "splits_tool_pair",
    "stored_summary_row", "stored_text", "summary_max_chars",
    "summary_of_row", "summary_row", "summary_row_id", "summary_row_text",
]
