"""Pure logic of turn-start compaction (SPEC §8): no I/O, unit-tested."""

from .context import (
                         Retained,
                         after_clear,
                         attachment_handles,
                         max_messages_window,
                         persisted_uris,
                         retained_context,
)
from .estimate import estimate_tokens
from .summarizers import extractive_summary, gist
from .summary_row import CONTINUE, PREAMBLE, summary_row, summary_row_id, summary_row_text
from .turn_start import (
                         FoldRequest,
                         Plan,
                         TurnStartSettings,
                         finish,
                         keep_start,
                         plan_turn_start,
                         splits_tool_pair,
                         summary_max_chars,
)

__all__ = [
                         "CONTINUE",
                         "PREAMBLE",
                         "FoldRequest",
                         "Plan",
                         "Retained",
                         "TurnStartSettings",
                         "after_clear",
                         "attachment_handles",
                         "estimate_tokens",
                         "extractive_summary",
                         "finish",
                         "gist",
                         "keep_start",
                         "max_messages_window",
                         "persisted_uris",
                         "plan_turn_start",
                         "retained_context",
                         "splits_tool_pair",
                         "summary_max_chars",
                         "summary_row",
                         "summary_row_id",
                         "summary_row_text",
]
