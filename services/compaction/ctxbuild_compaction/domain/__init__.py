"""Pure logic of compaction (SPEC §8–§10): no I/O, unit-tested."""

from .context import (
    Retained,
    after_clear,
    attachment_handles,
    max_messages_window,
    persisted_uris,
    retained_context,
)
from .estimate import estimate_tokens
from .extractive import RegexTokenizer, extractive_summary, rank
from .fold import FoldOutcome, FoldRequest
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
from .turn_start import (
    Plan,
    TurnStartSettings,
    finish,
    keep_start,
    plan_turn_start,
    render_served,
    splits_tool_pair,
    summary_max_chars,
)

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
