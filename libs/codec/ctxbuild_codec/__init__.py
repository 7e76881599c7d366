"""Shared codec library (SPEC §2–§4, §7): budgets, the trim primitive, codecs, tool policies, the pure halves of
both lanes, persisted-output envelopes and token counts. Every service that trims goes through this package."""

from . import envelopes, nontext
from .budgets import (
    CompactionBudget,
    compaction_budget,
    inflight_threshold,
    input_room,
    persist_threshold,
    summarizer_budgets,
    usable_window,
)
from .codecs import (
    CODECS,
    ENTITIES,
    TEXT_FIELD,
    Blob,
    Deflated,
    assemble,
    compact_json,
    deflate,
    extract_text,
    inflate_value,
    pointer,
    snippet,
    split_key,
)
from .lanes import (
    ORIGINAL_KEY,
    BlobToWrite,
    Cut,
    Original,
    TrimPlan,
    TrimRecord,
    apply_inflight,
    apply_persist,
    plan_inflight,
    plan_persist,
    records,
    trim_inflight,
    trim_persist,
)
from .policy import ToolPolicy, effective_tool_name, policy_for
from .trim import (
    HEAD_CHARS,
    PERSIST_MIN_CHARS,
    TAIL_CHARS,
    Excerpt,
    degraded_excerpt,
    excerpt,
    handle_prefix_from_uri,
    inline_truncate,
    marker,
    needs_persist_trim,
    needs_trim,
    render_marker,
    sha256_hex,
    total_lines,
    vfs_handle,
    vfs_uri,
)

__all__ = [
    "CODECS", "ENTITIES", "HEAD_CHARS", "ORIGINAL_KEY", "PERSIST_MIN_CHARS", "TAIL_CHARS", "TEXT_FIELD", "Blob",
    "BlobToWrite", "CompactionBudget", "Cut", "Deflated", "Excerpt", "Original", "ToolPolicy", "TrimPlan",
    "TrimRecord", "apply_inflight", "apply_persist", "assemble", "compact_json", "compaction_budget", "deflate",
    "degraded_excerpt", "effective_tool_name", "envelopes", "excerpt", "extract_text", "handle_prefix_from_uri",
    "inflate_value", "inflight_threshold", "inline_truncate", "input_room", "marker", "needs_persist_trim",
    "needs_trim", "nontext", "persist_threshold", "plan_inflight", "plan_persist", "pointer", "policy_for",
    "records", "render_marker", "sha256_hex", "snippet", "split_key", "summarizer_budgets", "total_lines",
    "trim_inflight", "trim_persist", "usable_window", "vfs_handle", "vfs_uri"
]
