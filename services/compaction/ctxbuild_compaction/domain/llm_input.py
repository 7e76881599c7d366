"""The ``llm`` summarizer's pure halves (SPEC §10): flatten the rows, wrap the previous summary, append the
instruction, fit the input budget (stub tool results 4000 → 1000 → 200 → 0 chars, then omit the oldest messages
but the first), and post-process the answer.

Stubbing uses the codec's ``inline_truncate`` (the one trim implementation), so a stubbed tool result reads
``<first N chars>\\n--- truncated (L lines, C chars total) ---``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ctxbuild_codec import inline_truncate
from ctxbuild_codec.envelopes import EnvelopeError, render
from ctxbuild_codec.tokens import MESSAGE_OVERHEAD, count_text

Message = dict[str, Any]
STUB_LEVELS = (4000, 1000, 200, 0)

SYSTEM = ("You summarize conversations between a user and an AI assistant that uses tools, so that the assistant "
          "can continue the work from the summary alone. Be factual and specific; never invent details.")
INSTRUCTION = (
    "Summarize the conversation above so that the work can continue from your summary alone.\n"
    "First think in <analysis>…</analysis>: go through the messages in order and note the user's requests, "
    "the decisions taken, the tool calls and what they returned, errors and how they were resolved.\n"
    "Then write the summary in <summary>…</summary> with these sections:\n"
    "1. Primary request and intent\n"
    "2. Completed work (with the key results, exact numbers, file names, identifiers and URIs)\n"
    "3. Failed or incomplete work\n"
    "4. Context to preserve (constraints, preferences, facts the assistant will need)\n"
    "5. Next step\n"
    "If a previous summary is given, merge it in: keep what still matters, drop what is obsolete.")
PREVIOUS = "[Summary of the earlier conversation]\n{summary}"
OMITTED = "[{n} earlier message{s} omitted — the summary must rely on the rest]"
_ANALYSIS = re.compile(r"<analysis>.*?(?:</analysis>|\Z)", re.DOTALL)
_SUMMARY = re.compile(r"<summary>(.*?)(?:</summary>|\Z)", re.DOTALL)
_NEWLINES = re.compile(r"\n{3,}")


@dataclass(frozen=True, slots=True)
class Line:
    """One flattened message; ``tool`` marks a tool result (the part stubbing shortens)."""

    role: str            # user | assistant
    text: str
    tool_id: str | None = None
    tool_text: str = ""


def output_text(output: dict[str, Any]) -> str:
    kind, value = output.get("type"), output.get("value")
    if kind == "persisted" and isinstance(value, dict):
        try:
            return output_text(render(value))
        except EnvelopeError:
            pass
    if isinstance(value, str):
        return value
    if kind == "content" and isinstance(value, list):
        return "\n".join(b.get("text", "") for b in value if isinstance(b, dict) and b.get("type") == "text"
                         and b.get("text"))
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _file(part: dict[str, Any]) -> str:
    name = part.get("displayName") or part.get("handle")
    if not name:
        return "[attachment]"
    return f"[image: {name}]" if str(part.get("mediaType", "")).startswith("image/") else f"[document: {name}]"


def flatten(rows: Sequence[Message]) -> list[Line]:
    """System rows dropped; a tool result becomes a user line ``[Tool result (<id>): …]``; a tool call becomes
    ``[Called tool: name(args)]`` in the assistant's line; attachments ``[image: f]``/``[document: f]``."""
    lines: list[Line] = []
    for row in rows:
        role = row.get("role")
        if role == "system":
            continue
        if role == "tool":
            for p in row.get("parts") or []:
                if p.get("type") == "tool-result":
                    text = output_text(p.get("output") or {})
                    lines.append(Line("user", "", p.get("toolCallId"), text))
            continue
        bits: list[str] = []
        for p in row.get("parts") or []:
            kind = p.get("type")
            if kind == "text" and p.get("text"):
                bits.append(p["text"])
            elif kind == "file":
                bits.append(_file(p))
            elif kind == "tool-call":
                args = json.dumps(p.get("input"), ensure_ascii=False, separators=(",", ":"))
                bits.append(f"[Called tool: {p.get('toolName', '')}({args})]")
        if bits:
            lines.append(Line("assistant" if role == "assistant" else "user", "\n".join(bits)))
    return lines


def render_line(line: Line, stub: int | None = None) -> str:
    if line.tool_id is None:
        return line.text
    body = line.tool_text
    if stub is not None and len(body) > stub:
        body = inline_truncate(body, head=stub, tail=0)
    return f"[Tool result ({line.tool_id}): {body}]"


def _messages(texts: Sequence[tuple[str, str]]) -> list[Message]:
    return [{"id": f"s{i}", "role": role, "parts": [{"type": "text", "text": text}]}
            for i, (role, text) in enumerate(texts)]


def _tokens(texts: Sequence[tuple[str, str]]) -> int:
    return sum(MESSAGE_OVERHEAD + count_text(t) for _, t in texts)


@dataclass(frozen=True, slots=True)
class LlmInput:
    messages: list[Message]
    tokens: int           # estimate (shared tokenizer) of the messages + system
    stub: int | None      # the stub level applied (None: tool results in full)
    omitted: int          # messages left out by the clamp


def build_input(previous: str | None, rows: Sequence[Message], input_budget: int) -> LlmInput:
    """The summarizer request's messages within ``input_budget`` tokens (system prompt included)."""
    lines = flatten(rows)
    head = [("user", PREVIOUS.format(summary=previous.strip()))] if previous and previous.strip() else []
    tail = [("user", INSTRUCTION)]
    fixed = count_text(SYSTEM)

    def build(stub: int | None) -> list[tuple[str, str]]:
        return [*head, *[(ln.role, render_line(ln, stub)) for ln in lines], *tail]

    texts, stub = build(None), None
    for level in STUB_LEVELS:
        if fixed + _tokens(texts) <= input_budget:
            break
        stub = level
        texts = build(level)
    omitted = 0
    if fixed + _tokens(texts) > input_budget and len(texts) > 2:
        body = texts[:-1]
        first, rest = body[0], body[1:]
        kept: list[tuple[str, str]] = []
        room = input_budget - fixed - _tokens([first, *tail]) - 40   # 40: the omission line
        for item in reversed(rest):
            cost = _tokens([item])
            if cost > room:
                break
            kept.append(item)
            room -= cost
        kept.reverse()
        omitted = len(rest) - len(kept)
        note = ("user", OMITTED.format(n=omitted, s="s" if omitted != 1 else ""))
        texts = [first, *([note] if omitted else []), *kept, *tail]
    if texts and texts[0][0] != "user":  # providers want the conversation to open with a user message
        texts.insert(0, ("user", "[The conversation to summarize follows.]"))
    return LlmInput(_messages(texts), fixed + _tokens(texts), stub, omitted)


def postprocess(text: str) -> str:
    """Drop ``<analysis>``, keep the ``<summary>`` body (the whole answer when there is none), collapse 3+
    newlines, strip."""
    text = _ANALYSIS.sub("", text or "")
    m = _SUMMARY.search(text)
    if m:
        text = m.group(1)
    return _NEWLINES.sub("\n\n", text).strip()
