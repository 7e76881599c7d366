"""Window arithmetic and thresholds (SPEC §2): one function per number, shared by both lanes."""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_TRUNCATE_THRESHOLD = 50_000
MIN_TRUNCATE_THRESHOLD = 2_000


def usable_window(window: float | None) -> int | None:
    """A window counts only if finite and > 0; otherwise every window-derived budget is off."""
    if window is None:
        return None
    try:
        w = float(window)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(w) or w <= 0:
        return None
    return int(w)


def input_room(window: float | None, reservation: int | None = None) -> int | None:
    w = usable_window(window)
    if w is None:
        return None
    if not reservation or reservation <= 0:
        return w
    return max(w - reservation, math.floor(0.2 * w))


@dataclass(frozen=True, slots=True)
class CompactionBudget:
    input_room: int
    trigger: int
    keep: int


def compaction_budget(window: float | None, reservation: int | None = None) -> CompactionBudget | None:
    room = input_room(window, reservation)
    if room is None:
        return None
    return CompactionBudget(room, math.floor(0.8 * room), math.floor(0.3 * room))


def inflight_threshold(configured: int | None, window: float | None, reservation: int | None = None) -> int:
    conf = max(MIN_TRUNCATE_THRESHOLD, configured if configured is not None else DEFAULT_TRUNCATE_THRESHOLD)
    room = input_room(window, reservation)
    if room is None:
        return conf
    return max(MIN_TRUNCATE_THRESHOLD, min(conf, math.floor(room * 0.1 * 3)))


def persist_threshold(configured: int | None) -> int:
    return max(MIN_TRUNCATE_THRESHOLD, configured if configured is not None else DEFAULT_TRUNCATE_THRESHOLD)


def summarizer_budgets(summarizer_window: int | None, chat_window: int | None = None) -> tuple[int, int]:
    """(output, input) token budgets for a summarizer call."""
    w = usable_window(summarizer_window) or usable_window(chat_window)
    if w is None:
        out = 4096
        return out, 2000
    out = min(max(math.floor(0.25 * w), 4096), min(16384, w - 1))
    return out, max(2000, math.floor(0.85 * (w - out)))
