"""Token estimates (SPEC §2.4, §8.6): trust the provider's usage for the prefix it covers, estimate the rest."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..records import usage_of, usage_tokens
from ..tokens import count_messages


def estimate_tokens(rows: Sequence[dict[str, Any]]) -> int:
    """The last assistant row with usage: inputTokens + outputTokens, plus an estimate of the rows after it;
    no such row → estimate every row.

    The usage is the size of the request that produced that row. When that request was smaller than the rows
    served now (the turn was compacted in-loop, so its usage covers a shorter prefix), the local estimate of all
    rows is larger and wins: the estimate never falls below what the shared tokenizer counts.
    """
    counted = count_messages(list(rows))
    for i in range(len(rows) - 1, -1, -1):
        usage = usage_of(rows[i])
        if usage:
            return max(usage_tokens(usage) + count_messages(list(rows[i + 1:])), counted)
    return counted
