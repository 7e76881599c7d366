"""HTML pieces of a served request (pure): text escaped, trim markers highlighted, archived URIs linked."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from markupsafe import Markup, escape

from .timeline import VFS_URI

TRIM_BLOCK = re.compile(r"<persisted-output>[\s\S]*?</persisted-output>")
TOKENS = re.compile(TRIM_BLOCK.pattern + "|" + VFS_URI.pattern)


def linkify(text: str, link: Callable[[str], str]) -> Markup:
    """``text`` as HTML: every ``<persisted-output>`` block (a trim marker) in a ``<mark class="trim">``, every
    ``context://vfs/…`` URI a link to its read-back (``link(uri)``)."""

    def uris(piece: str) -> str:
        out, at = [], 0
        for m in VFS_URI.finditer(piece):
            out.append(str(escape(piece[at:m.start()])))
            uri = m.group(0)
            out.append(f'<a class="uri" href="{escape(link(uri))}">{escape(uri)}</a>')
            at = m.end()
        out.append(str(escape(piece[at:])))
        return "".join(out)

    out, at = [], 0
    for m in TRIM_BLOCK.finditer(text):
        out.append(uris(text[at:m.start()]))
        out.append(f'<mark class="trim" title="trim marker: the output was cut here; the full text is archived">'
                   f'{uris(m.group(0))}</mark>')
        at = m.end()
    out.append(uris(text[at:]))
    return Markup("".join(out))


def pretty(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=2)


def part_view(part: Mapping[str, Any], link: Callable[[str], str]) -> dict[str, Any]:
    """A message part for the template: its kind, a title line, and its body as HTML."""
    kind = part.get("type")
    if kind in ("text", "reasoning"):
        return {"kind": kind, "title": kind, "html": linkify(part.get("text") or "", link)}
    if kind == "tool-call":
        return {"kind": kind, "title": f"tool call {part.get('toolName')} · {part.get('toolCallId')}",
                "html": linkify(pretty(part.get("input")), link)}
    if kind == "tool-result":
        output = part.get("output") or {}
        value = output.get("value")
        if isinstance(value, str):
            body = linkify(value, link)
        elif output.get("type") == "content" and isinstance(value, list):
            body = Markup("\n").join(linkify(b.get("text", "") if b.get("type") == "text" else pretty(b), link)
                                     for b in value if isinstance(b, Mapping))
        else:
            body = linkify(pretty(value), link)
        trimmed = bool(TRIM_BLOCK.search(str(value) if not isinstance(value, str) else value))
        return {"kind": kind, "title": f"tool result {part.get('toolName')} · {part.get('toolCallId')} "
                                       f"({output.get('type')})", "html": body, "trimmed": trimmed,
                "toolCallId": part.get("toolCallId")}
    return {"kind": str(kind), "title": str(kind), "html": linkify(pretty(part), link)}


def has_trim_marker(message: Mapping[str, Any]) -> bool:
    return any(TRIM_BLOCK.search(json.dumps(p, ensure_ascii=False)) for p in message.get("parts") or [])
