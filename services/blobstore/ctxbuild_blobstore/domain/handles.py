"""Attachment handles: the display name, made unique per conversation (SPEC §1)."""

from __future__ import annotations

from collections.abc import Collection


def unique_handle(display_name: str, taken: Collection[str]) -> str:
    """``name``, else ``name (2)``, ``name (3)``… — the first one not taken."""
    if display_name not in taken:
        return display_name
    n = 2
    while f"{display_name} ({n})" in taken:
        n += 1
    return f"{display_name} ({n})"
