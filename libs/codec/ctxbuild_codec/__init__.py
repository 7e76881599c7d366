"""Shared codec library: trim primitive, markers, budgets, tokens (codecs and envelopes grow here)."""

from .budgets import (CompactionBudget, compaction_budget, inflight_threshold, input_room, persist_threshold,
                      summarizer_budgets, usable_window)
from .trim import (HEAD_CHARS, TAIL_CHARS, Excerpt, excerpt, handle_prefix_from_uri, inline_truncate, marker,
                   needs_trim, render_marker, sha256_hex, total_lines, vfs_handle, vfs_uri)

__all__ = [
    "HEAD_CHARS", "TAIL_CHARS", "CompactionBudget", "Excerpt", "compaction_budget", "excerpt",
    "handle_prefix_from_uri", "inflight_threshold", "inline_truncate", "input_room", "marker", "needs_trim",
    "persist_threshold", "render_marker", "sha256_hex", "summarizer_budgets", "total_lines", "usable_window",
    "vfs_handle", "vfs_uri",
]
