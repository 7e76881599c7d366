"""The summary row served in place of the folded rows (SPEC §8.9).

Its bytes are a pure function of (boundary id, summary, attachment handles, archived URIs), and the handler
computes the last two from the rows *up to the boundary* — so adding a later attachment never changes them and
the provider's prefix cache keeps hitting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PREAMBLE = ("This session is being continued from an earlier conversation that ran out of context. "
            "The earlier part of the conversation is summarized below.")
CONTINUE = ("Continue the conversation from where it left off without acknowledging this summary; "
            "the messages after it are the most recent ones.")
ID_PREFIX = "compaction:"


def summary_row_id(boundary_id: str) -> str:
    return ID_PREFIX + boundary_id


def summary_row_text(summary: str, handles: Sequence[str] = (), uris: Sequence[str] = ()) -> str:
    text = f"{PREAMBLE}\n\n{summary.strip()}\n\n{CONTINUE}"
    if handles:
        text += ("\n\n[Files attached in this conversation remain readable in full via the read_file tool: "
                 + ", ".join(handles) + "]")
    if uris:
        text += ("\n\n[Tool output archived from this conversation remains readable in full via the fs_read tool at: "
                 + ", ".join(uris) + "]")
    return text


def summary_row(boundary_id: str, summary: str, handles: Sequence[str] = (),
                uris: Sequence[str] = ()) -> dict[str, Any]:
    return {"id": summary_row_id(boundary_id), "role": "user",
            "parts": [{"type": "text", "text": summary_row_text(summary, handles, uris)}]}
