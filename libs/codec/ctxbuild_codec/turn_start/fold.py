"""What every summarizer takes and gives (SPEC §10): one interface for ``llm``, ``extractive`` and ``masking``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]


@dataclass(frozen=True, slots=True)
class FoldRequest:
    """The previous summary (text of a summary row being folded again, or None), the rows to fold (the
    increment), and the size the text summary should stay under.

    ``prefix`` holds rows of an earlier fold that are not a summary (masked rows after a masking fallback): a
    text summarizer folds them again together with ``rows``; masking leaves them as they are.
    """

    previous_summary: str | None
    rows: list[Message]
    max_chars: int
    prefix: list[Message] = field(default_factory=list)
    conversation_id: str = ""
    turn_id: str | None = None
    phase: str = "turn-start"

    def input_rows(self) -> list[Message]:
        return [*self.prefix, *self.rows]


@dataclass(slots=True)
class FoldOutcome:
    """A text ``summary`` (llm, extractive) or replacement ``rows`` (masking), and what it cost."""

    summarizer: str
    summary: str | None = None
    rows: list[Message] | None = None
    input_tokens: int = 0     # what the summarizer was given (tokens of its request; masking: of the rows it read)
    output_tokens: int = 0
    calls: int = 0            # model calls
    fallback_from: str | None = None
    error: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return self.rows is None and not (self.summary and self.summary.strip())
