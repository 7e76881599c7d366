"""The ``extractive`` summarizer (SPEC §10): no LLM, works offline, deterministic.

Sentence selection is sumy's TextRank (a maintained summarization library) over the folded user/assistant texts,
without the self-loops sumy's graph puts on the diagonal (with them a sentence that shares no word with any other
keeps all its weight and ranks as central as the best one; the TextRank paper has no self-loops).
sumy's default tokenizer needs NLTK's ``punkt`` data, which is a download at run time and cannot work offline,
so sentences and words are split by :class:`RegexTokenizer` below (sumy's ``PlaintextParser`` takes any
tokenizer with ``to_sentences``/``to_words``); stemming (Snowball, pure code) and the stop-word list ship with
sumy and nltk.

Output, one entry per folded row that has something to say, oldest first::

    Summary of the conversation before that:      (only when a previous summary is folded again)
    <previous summary, reduced by TextRank to its most central lines when it is too long>

    Earlier messages:
    - User: <its most central sentences> [attached: report.pdf]
    - Assistant: <its most central sentences> [called: read_file(filename=service.log, offset=0) → archived at
      context://vfs/vfs_….txt]
    - Tool error (web_fetch): <first line>

When over ``max_chars`` the oldest entries give way first (``- … (N earlier messages omitted)``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy
from ctxbuild_codec.records import offload_of
from sumy.models.dom import ObjectDocumentModel, Paragraph, Sentence
from sumy.nlp.stemmers import Stemmer
from sumy.summarizers.text_rank import TextRankSummarizer
from sumy.utils import get_stop_words

LANGUAGE = "english"
ENTRY_CHARS = 300          # at most this much text per entry
MAX_SENTENCES = 200        # TextRank is quadratic in sentences: the newest this many are ranked, older rank last
ARGS_CHARS = 80
_WS = re.compile(r"\s+")


class RegexTokenizer:
    """sumy tokenizer without NLTK data: sentences end at . ! ? (and CJK 。！？) followed by space, or at a line
    break; words are runs of letters (with inner ' or -), like sumy's own word filter."""

    language = LANGUAGE
    _SENTENCES = re.compile(r"(?<=[.!?])\s+|(?<=[。！？])|\n+")
    _WORDS = re.compile(r"[^\W\d_](?:[^\W\d_]|['-](?=[^\W\d_]))*")

    def to_sentences(self, paragraph: str) -> tuple[str, ...]:
        return tuple(s.strip() for s in self._SENTENCES.split(paragraph) if s and s.strip())

    def to_words(self, sentence: str) -> tuple[str, ...]:
        return tuple(self._WORDS.findall(sentence))


TOKENIZER = RegexTokenizer()


class TextRank(TextRankSummarizer):
    """sumy's TextRank with an empty diagonal (no sentence votes for itself)."""

    def _create_matrix(self, document):
        words = [self._to_words_set(s) for s in document.sentences]
        n = len(words)
        weights = numpy.zeros((n, n))
        for i in range(n):
            for j in range(i + 1, n):
                if words[i] and words[j]:
                    weights[i, j] = weights[j, i] = self._rate_sentences_edge(words[i], words[j])
        weights /= (weights.sum(axis=1)[:, numpy.newaxis] + self._ZERO_DIVISION_PREVENTION)
        return numpy.full((n, n), (1.0 - self.damping) / n) + self.damping * weights


@cache
def _textrank() -> TextRank:
    s = TextRank(Stemmer(LANGUAGE))
    s.stop_words = get_stop_words(LANGUAGE)
    return s


def rank(sentences: Sequence[str]) -> list[int]:
    """Indices of ``sentences`` from most to least central (TextRank); ties keep document order. Only the newest
    :data:`MAX_SENTENCES` are ranked (the others follow, newest first)."""
    n = len(sentences)
    if n <= 1:
        return list(range(n))
    start = max(0, n - MAX_SENTENCES)
    objs = [Sentence(s, TOKENIZER) for s in sentences[start:]]
    if not any(o.words for o in objs):
        ranked = list(range(start, n))
    else:
        order: list[int] = []

        def take(infos):  # sumy hands a callable count the infos sorted by rating (desc): read the order off it
            order.extend(i.order for i in infos)
            return infos

        _textrank()(ObjectDocumentModel([Paragraph(objs)]), take)
        ratings = {i: pos for pos, i in enumerate(order)}
        ranked = [start + i for i in sorted(range(len(objs)), key=lambda i: (ratings.get(i, len(objs)), i))]
    return ranked + list(range(start - 1, -1, -1))


def _clean(text: str) -> str:
    return _WS.sub(" ", text).strip()


def _cap(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def _text_of(row: dict[str, Any]) -> str:
    return "\n".join(p.get("text", "") for p in row.get("parts") or [] if p.get("type") == "text")


def _call(part: dict[str, Any]) -> str:
    args = part.get("input")
    if isinstance(args, dict):
        shown = ", ".join(f"{k}={v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
                          for k, v in args.items())
    else:
        shown = json.dumps(args, ensure_ascii=False)
    return f"{part.get('toolName', '')}({_cap(_clean(shown), ARGS_CHARS)})"


def _results(rows: Sequence[dict[str, Any]]) -> dict[tuple[int, str], str]:
    """(row of the call, toolCallId) → what its result was: where it is archived, an error, or its size. Paired
    by position (a result answers the latest call with its id before it): ids are only unique within a turn."""
    out: dict[tuple[int, str], str] = {}
    pending: dict[str, int] = {}
    for r, row in enumerate(rows):
        for p in row.get("parts") or []:
            cid = p.get("toolCallId")
            if p.get("type") == "tool-call":
                pending[cid] = r
                continue
            if p.get("type") != "tool-result" or cid not in pending:
                continue
            key = (pending.pop(cid), cid)
            off, output = offload_of(p) or {}, p.get("output") or {}
            if off.get("uri"):
                out[key] = f"archived at {off['uri']}"
            elif str(output.get("type", "")).startswith("error"):
                out[key] = "error"
            else:
                value = output.get("value")
                size = len(value) if isinstance(value, str) else len(json.dumps(value, ensure_ascii=False))
                out[key] = f"{size:,} chars"
    return out


def _suffix(row: dict[str, Any], results: dict[tuple[int, str], str], r: int) -> str:
    parts = row.get("parts") or []
    if row.get("role") == "user":
        files = [p.get("displayName") or p.get("handle", "") for p in parts if p.get("type") == "file"]
        return f" [attached: {', '.join(files)}]" if files else ""
    if row.get("role") == "assistant":
        calls = list(dict.fromkeys(
            _call(p) + (f" → {results[(r, p.get('toolCallId'))]}" if (r, p.get("toolCallId")) in results else "")
            for p in parts if p.get("type") == "tool-call"))
        return f" [called: {'; '.join(calls)}]" if calls else ""
    return ""


def _tool_errors(row: dict[str, Any]) -> str | None:
    errors = []
    for p in row.get("parts") or []:
        out = p.get("output") or {}
        if p.get("type") == "tool-result" and str(out.get("type", "")).startswith("error"):
            value = out.get("value")
            first = next((ln for ln in (value if isinstance(value, str) else json.dumps(value)).splitlines()
                          if ln.strip()), "")
            errors.append(f"- Tool error ({p.get('toolName', '')}): {_cap(_clean(first), 160)}")
    return "\n".join(errors) or None


_OMITTED = re.compile(r"^- … \((\d+) earlier (?:point|message)s? omitted\)$")


def _reduce(previous: str, cap: int) -> str:
    """The previous summary as is when it fits, else its most central lines (TextRank) in their order, after one
    line counting what was left out (earlier such counts add up: folds nest without growing)."""
    prev = previous.strip()
    if len(prev) <= cap:
        return prev
    omitted = 0
    lines: list[str] = []
    for ln in prev.splitlines():
        m = _OMITTED.match(ln.strip())
        if m:
            omitted += int(m.group(1))
        elif ln.strip():
            lines.append(ln)
    keep: set[int] = set()
    used = len("- … (NNNNN earlier points omitted)\n")
    for i in rank(lines):
        if used + len(lines[i]) + 1 > cap:
            continue
        keep.add(i)
        used += len(lines[i]) + 1
    kept = [lines[i] for i in sorted(keep)]
    omitted += len(lines) - len(kept)
    head = [f"- … ({omitted} earlier point{'s' if omitted != 1 else ''} omitted)"] if omitted else []
    return _cap("\n".join(head + kept), cap)


def extractive_summary(previous: str | None, rows: Sequence[dict[str, Any]], max_chars: int = 4_000) -> str:
    """``previous`` (wrapped, reduced to at most half of ``max_chars``) + one entry per folded row."""
    head = ""
    if previous and previous.strip():
        head = f"Summary of the conversation before that:\n{_reduce(previous, max(200, max_chars // 2))}\n\n"

    # every user/assistant sentence of the fold, ranked together: the entries keep their most central ones
    sentences: list[tuple[int, str]] = []
    for r, row in enumerate(rows):
        if row.get("role") in ("user", "assistant"):
            sentences += [(r, _clean(s)) for s in TOKENIZER.to_sentences(_text_of(row)) if _clean(s)]
    order = rank([s for _, s in sentences])
    chosen: dict[int, list[int]] = {}
    budget = dict.fromkeys(range(len(rows)), ENTRY_CHARS)
    best: dict[int, int] = {}
    for k in order:   # the most central sentences that fit their entry; an entry with none gets its best one, cut
        r, s = sentences[k]
        best.setdefault(r, k)
        if len(s) + 1 <= budget[r]:
            chosen.setdefault(r, []).append(k)
            budget[r] -= len(s) + 1
    for r, k in best.items():
        chosen.setdefault(r, [k])

    entries: list[str] = []
    results = _results(rows)
    for r, row in enumerate(rows):
        role = row.get("role")
        if role in ("user", "assistant"):
            text = _cap(" ".join(sentences[k][1] for k in sorted(chosen.get(r, []))), ENTRY_CHARS)
            suffix = _suffix(row, results, r)
            if text or suffix:
                label = "User" if role == "user" else "Assistant"
                entries.append(f"- {label}: {text}{suffix}" if text else f"- {label}:{suffix}")
        elif role == "tool":
            err = _tool_errors(row)
            if err:
                entries.append(err)
    if not entries:
        return head.strip()
    title = "Earlier messages:\n"
    room = max_chars - len(head) - len(title)
    kept: list[str] = []
    used = 0
    for e in reversed(entries):
        if used + len(e) + 1 > room and kept:
            break
        kept.append(_cap(e, room) if not kept else e)
        used += len(kept[-1]) + 1
    kept.reverse()
    omitted = len(entries) - len(kept)
    if omitted:
        kept.insert(0, f"- … ({omitted} earlier message{'s' if omitted != 1 else ''} omitted)")
    return (head + title + "\n".join(kept)).strip()
