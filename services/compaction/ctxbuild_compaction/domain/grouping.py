"""Atomic turn grouping (SPEC §9) and the tool-pair invariant (SPEC §13.6).

A *group* is what compaction may fold or keep as a whole: an assistant row that calls tools together with every
row up to the last tool row answering those calls; any other row is a group of its own. System rows are pinned:
they are never folded and are not counted as groups. ``[sys, u, a, t, t, u, a]`` is 4 groups:
``[u] [a t t] [u] [a]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Message = dict[str, Any]


def call_ids(row: Message) -> list[str]:
    return [p.get("toolCallId") for p in row.get("parts") or [] if p.get("type") == "tool-call"]


def result_ids(row: Message) -> list[str]:
    return [p.get("toolCallId") for p in row.get("parts") or [] if p.get("type") == "tool-result"]


def group_rows(rows: Sequence[Message]) -> tuple[list[int], list[list[int]]]:
    """(indices of pinned system rows, groups as lists of row indices, oldest first)."""
    pinned: list[int] = []
    groups: list[list[int]] = []
    open_group: list[int] | None = None
    pending: set[str] = set()
    for i, row in enumerate(rows):
        if row.get("role") == "system":
            pinned.append(i)
            continue
        if open_group is not None:
            open_group.append(i)
            pending -= set(result_ids(row))
            pending |= set(call_ids(row)) if row.get("role") == "assistant" else set()
            if not pending:
                open_group = None
            continue
        calls = call_ids(row) if row.get("role") == "assistant" else []
        if calls:
            open_group = [i]
            pending = set(calls)
            groups.append(open_group)
        else:
            groups.append([i])
    return pinned, groups


def count_groups(rows: Sequence[Message]) -> int:
    return len(group_rows(rows)[1])


def orphans(rows: Sequence[Message]) -> dict[str, list[str]]:
    """Tool calls without a result and results without a call, in one request: must always be empty."""
    calls: list[str] = []
    results: list[str] = []
    for row in rows:
        calls += call_ids(row)
        results += result_ids(row)
    call_set, result_set = set(calls), set(results)
    return {"calls": [c for c in calls if c not in result_set], "results": [r for r in results if r not in call_set]}
