"""The summary row served in place of the folded rows (SPEC §8.9, §15.2).

Its bytes are a pure function of (boundary id, summary, attachment handles, transcript URIs). The handles and
URIs are fixed when the summary is made — the conversation's authoritative attachment list (attachments uploaded
without a message have no file part to find them by) and the transcript blobs of this fold and of every earlier
fold it summarizes — and stored with it: the stored summary text is ``<summary>`` followed by the row's attachment
and transcript lines (the *trailer*). Every later turn rebuilds the row from the stored text alone, so a later
attachment never changes its bytes and the provider's prefix cache keeps hitting.

The transcript line names one URI per fold, oldest first (a fold's transcript holds only its increment, so the
row names them all: every folded output stays one fs_read away from the request). One fold's line is exactly
``\n\n[The full transcript of the folded part is readable via the fs_read tool at: <uri>]``. The older archive line
(every archived output's URI, which grew past 64 KiB on long runs) is still read from stored summaries, never
written.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

PREAMBLE = ("This session is being continued from an earlier conversation that ran out of context. "
            "The earlier part of the conversation is summarized below.")
CONTINUE = ("Continue the conversation from where it left off without acknowledging this summary; "
            "the messages after it are the most recent ones.")
ID_PREFIX = "compaction:"


OPENING = re.compile(r"\[The conversation's first request, verbatim \((\d+) chars\):\]\n")


def with_opening(summary: str, opening: str | None) -> str:
    """The summary with the conversation's first request (the task of a multi-turn session) ahead of it,
    verbatim: a fold that takes the request away keeps its words in the row (SPEC §15.2, the task in every
    request). Length-prefixed, so any text — newlines, brackets — reads back exactly."""
    if not opening:
        return summary.strip()
    return f"[The conversation's first request, verbatim ({len(opening)} chars):]\n{opening}\n\n{summary.strip()}"


def split_opening(text: str | None) -> tuple[str | None, str | None]:
    """(first request, the summary without it) of a summary text (the inverse of :func:`with_opening`)."""
    m = OPENING.match(text or "")
    if not m:
        return None, text
    start = m.end()
    return text[start: start + int(m[1])], text[start + int(m[1]):].lstrip("\n")


def opening_of_rows(rows: Sequence[dict[str, Any]]) -> str | None:
    """The first request a summary row among ``rows`` carries (a folded turn-start row keeps it)."""
    for row in rows:
        text = summary_of_row(row)
        opening = split_opening(text)[0] if text is not None else None
        if opening:
            return opening
    return None


def row_text(row: dict[str, Any]) -> str:
    """A user row's words: its text parts, in order."""
    return "\n".join(p.get("text", "") for p in row.get("parts") or [] if p.get("type") == "text")


def summary_row_id(boundary_id: str) -> str:
    return ID_PREFIX + boundary_id


FILES_LINE = "[Files attached in this conversation remain readable in full via the read_file tool: "
TRANSCRIPT_LINE = "[The full transcript of the folded part is readable via the fs_read tool at: "
# legacy: archived outputs an older summary row named
ARCHIVE_LINE = "[Tool output archived from this conversation remains readable in full via the fs_read tool at: "


def trailer(handles: Sequence[str] = (), transcripts: Sequence[str] = ()) -> str:
    text = ""
    if handles:
        text += "\n\n" + FILES_LINE + ", ".join(handles) + "]"
    if transcripts:
        text += "\n\n" + TRANSCRIPT_LINE + ", ".join(transcripts) + "]"
    return text


def summary_row_text(summary: str, handles: Sequence[str] = (), transcripts: Sequence[str] = ()) -> str:
    return f"{PREAMBLE}\n\n{summary.strip()}\n\n{CONTINUE}" + trailer(handles, transcripts)


def stored_text(summary: str, handles: Sequence[str] = (), transcripts: Sequence[str] = ()) -> str:
    """What CompactionSummaryRecorded stores: the summary and the row's lines as of the fold."""
    return summary.strip() + trailer(handles, transcripts)


def split_stored(text: str) -> tuple[str, str | None]:
    """(summary, trailer) of a stored summary; trailer None when it has no attachment/archive line."""
    pieces = text.strip().split("\n\n")
    cut = len(pieces)
    while cut > 1 and pieces[cut - 1].startswith((FILES_LINE, TRANSCRIPT_LINE, ARCHIVE_LINE)) \
            and pieces[cut - 1].endswith("]") and "\n" not in pieces[cut - 1]:
        cut -= 1
    if cut == len(pieces):
        return text.strip(), None
    return "\n\n".join(pieces[:cut]), "".join("\n\n" + p for p in pieces[cut:])


def trailer_refs(stored: str) -> tuple[list[str], list[str]]:
    """(handles, uris) named by a stored summary's trailer — what the rows up to its boundary retained, so a
    turn start that reads only the rows after the boundary still knows them. ``uris``: its transcripts (and the
    archived outputs of a legacy archive line)."""
    _, tail = split_stored(stored)
    handles: list[str] = []
    uris: list[str] = []
    for line in (tail or "").split("\n\n"):
        if line.startswith(FILES_LINE):
            handles += [h for h in line[len(FILES_LINE):-1].split(", ") if h]
        elif line.startswith(ARCHIVE_LINE):
            uris += [u for u in line[len(ARCHIVE_LINE):-1].split(", ") if u]
        elif line.startswith(TRANSCRIPT_LINE):
            uris += [u for u in line[len(TRANSCRIPT_LINE):-1].split(", ") if u]
    return handles, uris


def transcripts_of(text: str) -> list[str]:
    """Transcript URIs a summary row's (or a stored summary's) text names, oldest first."""
    out: list[str] = []
    for line in text.split("\n\n"):
        if line.startswith(TRANSCRIPT_LINE) and line.endswith("]") and "\n" not in line:
            out += [u for u in line[len(TRANSCRIPT_LINE):-1].split(", ") if u]
    return out


def row_transcripts(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Transcript URIs named by the summary rows among ``rows`` (a folded turn-start row keeps its links)."""
    out: list[str] = []
    for row in rows:
        if is_summary_row(row):
            for p in row.get("parts") or []:
                if p.get("type") == "text":
                    out += transcripts_of(p.get("text", ""))
    return list(dict.fromkeys(out))


def stored_summary_row(boundary_id: str, stored: str, handles: Sequence[str] = ()) -> dict[str, Any]:
    """The row of a stored summary: its own trailer when it has one, else a files line from ``handles``."""
    summary, tail = split_stored(stored)
    if tail is None:
        return summary_row(boundary_id, summary, handles)
    return {"id": summary_row_id(boundary_id), "role": "user",
            "parts": [{"type": "text", "text": f"{PREAMBLE}\n\n{summary}\n\n{CONTINUE}{tail}"}]}


def summary_row(boundary_id: str, summary: str, handles: Sequence[str] = (),
                transcripts: Sequence[str] = ()) -> dict[str, Any]:
    return {"id": summary_row_id(boundary_id), "role": "user",
            "parts": [{"type": "text", "text": summary_row_text(summary, handles, transcripts)}]}


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
