"""The compaction use cases (the only place that combines the pure domain with the adapters, through ports):
:mod:`.compact` serves ``ctx.compact.turn_start`` and ``ctx.compact.in_loop``; :mod:`.summarizers` folds."""

from .compact import ArchivePort, CheckpointPort, Compaction, HistoryPort, in_loop, turn_start
from .summarizers import (
    KINDS,
    Choice,
    ExtractiveSummarizer,
    LlmSummarizer,
    MaskingSummarizer,
    PutText,
    Summarizer,
    Summarizers,
    as_summarizers,
    fold_with_fallback,
)

__all__ = [
    "KINDS", "ArchivePort", "CheckpointPort", "Choice", "Compaction", "ExtractiveSummarizer", "HistoryPort",
    "LlmSummarizer", "MaskingSummarizer", "PutText", "Summarizer", "Summarizers", "as_summarizers",
    "fold_with_fallback", "in_loop", "turn_start",
]
