"""Summarizers (SPEC §10). ``extractive`` needs no LLM, so compaction works offline: one line per folded
user/assistant row (its first sentence, capped), the tools the assistant called and the files the user attached,
after the previous summary. Deterministic: the same rows always give the same bytes."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

ENTRY_CHARS = 200
_WS = re.compile(r"\s+")
_SENTENCE_END = re.compile(r"(?<=[.!?。！？])\s")


def _text_of(row: dict[str, Any]) -> str:
    return "\n".join(p.get("text", "") for p in row.get("parts") or [] if p.get("type") == "text")


def gist(text: str, limit: int = ENTRY_CHARS) -> str:
    """First non-empty line, then its first sentence if that is long enough; whitespace collapsed; capped."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    line = _WS.sub(" ", line)
    m = _SENTENCE_END.search(line)
    if m and m.start() >= 20:
        line = line[: m.start()]
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"


def _entry(row: dict[str, Any]) -> str | None:
    role = row.get("role")
    parts = row.get("parts") or []
    text = gist(_text_of(row))
    if role == "user":
        files = [p.get("displayName") or p.get("handle", "") for p in parts if p.get("type") == "file"]
        extra = f" [attached: {', '.join(files)}]" if files else ""
        return f"- User: {text}{extra}" if text or extra else None
    if role == "assistant":
        tools = list(dict.fromkeys(p.get("toolName", "") for p in parts if p.get("type") == "tool-call"))
        extra = f" [called tools: {', '.join(tools)}]" if tools else ""
        return f"- Assistant: {text}{extra}" if text or extra else None
    if role == "tool":
        failed = [p.get("toolName", "") for p in parts
                  if p.get("type") == "tool-result" and str((p.get("output") or {}).get("type", "")).startswith("error")]
        return f"- Tool error: {', '.join(failed)}" if failed else None
    return None  # system rows are not summarized


def extractive_summary(previous: str | None, rows: Sequence[dict[str, Any]], max_chars: int = 4_000) -> str:
    """``previous`` (wrapped) + one entry per folded row; the oldest entries give way first when over
    ``max_chars``. Empty when there is nothing to say."""
    head = ""
    if previous and previous.strip():
        prev = previous.strip()
        cap = max(200, max_chars // 2)
        if len(prev) > cap:
            prev = prev[: cap - 1].rstrip() + "…"
        head = f"Summary of the conversation before that:\n{prev}\n\n"
    entries = [e for e in (_entry(r) for r in rows) if e]
    if not entries:
        return head.strip()
    title = "Earlier messages:\n"
    room = max_chars - len(head) - len(title)
    kept: list[str] = []
    used = 0
    for e in reversed(entries):
        if used + len(e) + 1 > room and kept:
            break
        kept.append(e)
        used += len(e) + 1
    kept.reverse()
    omitted = len(entries) - len(kept)
    if omitted:
        kept.insert(0, f"- … ({omitted} earlier message{'s' if omitted != 1 else ''} omitted)")
    return (head + title + "\n".join(kept)).strip()
