"""The summary row served in place of the folded rows (SPEC §8.9).

Its bytes are a pure function of (boundary id, summary, attachment handles, archived URIs). The handles and URIs
are fixed when the summary is made — the conversation's authoritative attachment list (attachments uploaded
without a message have no file part to find them by) and the outputs archived up to the boundary — and stored
with it: the stored summary text is ``<summary>`` followed by the row's attachment and archive lines (the
*trailer*). Every later turn rebuilds the row from the stored text alone, so a later attachment never changes its
bytes and the provider's prefix cache keeps hitting. (A stored summary without a trailer — written by an older
version or by hand — gets its lines from the rows up to the boundary.)
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


FILES_LINE = "[Files attached in this conversation remain readable in full via the read_file tool: "
ARCHIVE_LINE = "[Tool output archived from this conversation remains readable in full via the fs_read tool at: "


def trailer(handles: Sequence[str] = (), uris: Sequence[str] = ()) -> str:
    text = ""
    if handles:
        text += "\n\n" + FILES_LINE + ", ".join(handles) + "]"
    if uris:
        text += "\n\n" + ARCHIVE_LINE + ", ".join(uris) + "]"
    return text


def summary_row_text(summary: str, handles: Sequence[str] = (), uris: Sequence[str] = ()) -> str:
    return f"{PREAMBLE}\n\n{summary.strip()}\n\n{CONTINUE}" + trailer(handles, uris)


def stored_text(summary: str, handles: Sequence[str] = (), uris: Sequence[str] = ()) -> str:
    """What CompactionSummaryRecorded stores: the summary and the row's lines as of the fold."""
    return summary.strip() + trailer(handles, uris)


def split_stored(text: str) -> tuple[str, str | None]:
    """(summary, trailer) of a stored summary; trailer None when it has no attachment/archive line."""
    pieces = text.strip().split("\n\n")
    cut = len(pieces)
    while cut > 1 and pieces[cut - 1].startswith((FILES_LINE, ARCHIVE_LINE)) and pieces[cut - 1].endswith("]") \
            and "\n" not in pieces[cut - 1]:
        cut -= 1
    if cut == len(pieces):
        return text.strip(), None
    return "\n\n".join(pieces[:cut]), "".join("\n\n" + p for p in pieces[cut:])


def trailer_refs(stored: str) -> tuple[list[str], list[str]]:
    """(handles, uris) named by a stored summary's trailer — what the rows up to its boundary retained, so a
    turn start that reads only the rows after the boundary still knows them."""
    _, tail = split_stored(stored)
    handles: list[str] = []
    uris: list[str] = []
    for line in (tail or "").split("\n\n"):
        if line.startswith(FILES_LINE):
            handles += [h for h in line[len(FILES_LINE):-1].split(", ") if h]
        elif line.startswith(ARCHIVE_LINE):
            uris += [u for u in line[len(ARCHIVE_LINE):-1].split(", ") if u]
    return handles, uris


def stored_summary_row(boundary_id: str, stored: str, handles: Sequence[str] = (),
                       uris: Sequence[str] = ()) -> dict[str, Any]:
    """The row of a stored summary: its own trailer when it has one, else lines from ``handles``/``uris``."""
    summary, tail = split_stored(stored)
    if tail is None:
        return summary_row(boundary_id, summary, handles, uris)
    return {"id": summary_row_id(boundary_id), "role": "user",
            "parts": [{"type": "text", "text": f"{PREAMBLE}\n\n{summary}\n\n{CONTINUE}{tail}"}]}


def summary_row(boundary_id: str, summary: str, handles: Sequence[str] = (),
                uris: Sequence[str] = ()) -> dict[str, Any]:
    return {"id": summary_row_id(boundary_id), "role": "user",
            "parts": [{"type": "text", "text": summary_row_text(summary, handles, uris)}]}


def is_summary_row(row: dict[str, Any]) -> bool:
    return str(row.get("id", "")).startswith(ID_PREFIX) and row.get("role") == "user"


def summary_of_row(row: dict[str, Any]) -> str | None:
    """The summary a summary row carries (the inverse of :func:`summary_row_text`); None for any other row.

    A summary row is folded again as the *previous summary* (wrapped), never as an ordinary user message.
    """
    if not is_summary_row(row):
        return None
    parts = row.get("parts") or []
    if len(parts) != 1 or parts[0].get("type") != "text":
        return None
    text = parts[0].get("text", "")
    head, end = f"{PREAMBLE}\n\n", f"\n\n{CONTINUE}"
    if not text.startswith(head) or end not in text:
        return None
    return text[len(head): text.rindex(end)]
