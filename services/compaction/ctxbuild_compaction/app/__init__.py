"""The compaction use cases (the only place that combines the pure domain with the adapters, through ports):
:mod:`.compact` serves ``ctx.compact.turn_start`` and ``ctx.compact.in_loop``; :mod:`.summarizers` folds."""

from .compact import Compaction, in_loop, turn_start
from .summarizers import (
           ExtractiveSummarizer,
           LlmSummarizer,
           MaskingSummarizer,
           Summarizers,
           fold_with_fallback,
)

__all__ = ["Compaction", "ExtractiveSummarizer", "LlmSummarizer", "MaskingSummarizer", "Summarizers",
           "fold_with_fallback", "in_loop", "turn_start"]
