"""The transcript of a fold (SPEC §15.2), pure: the folded messages in order, as plain text, with tool calls and
tool outputs in full. It is archived as one content-addressed blob and the summary row names its URI, so folding
loses nothing: the model reads it back with fs_read (page by page, or searched with ``pattern``).

Its bytes depend only on what was folded — message ids, roles and parts — so the same folded span always gives
the same blob (the same URI, a byte-stable summary row). Outputs that were offloaded or persisted are rendered
from their full original text (:func:`needs_full`, resolved by the caller through the blob store); an output
whose original could not be read back keeps its served form (its marker still names the blob).

Layout (line-oriented, so a pattern search finds a message header near any hit)::

    ### [1] user <id>
    <text>
    ### [2] assistant <id>
    <text>
    [tool call <toolCallId>] <toolName> <input as compact JSON>
    ### [3] tool <id>
    [tool result <toolCallId>] <toolName> (<output type>)
    <output text, in full>
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ctxbuild_codec.records import offload_of

Message = dict[str, Any]
MEDIA_TYPE = "text/plain"


def needs_full(part: Mapping[str, Any]) -> bool:
    """A tool result whose served output is not the whole original (offloaded in flight, or a persisted
    envelope): its original must be read back from the blob store before it is written to a transcript."""
    if part.get("type") != "tool-result":
        return False
    output = part.get("output") or {}
    return output.get("type") == "persisted" or offload_of(part) is not None


def _json(value: Any) -> str:
    # compact, as the provider adapters put JSON on the wire: the transcript holds the bytes the model was shown
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _output_text(output: Mapping[str, Any]) -> str:
    kind, value = output.get("type"), output.get("value")
    if kind in ("text", "error-text") and isinstance(value, str):
        return value
    if kind == "content" and isinstance(value, list):
        pieces = []
        for item in value:
            if isinstance(item, Mapping) and item.get("type") == "text" and isinstance(item.get("text"), str):
                pieces.append(item["text"])
            else:  # an image or other media: named, not inlined (it has its own blob when it was offloaded)
                item = item if isinstance(item, Mapping) else {}
                media = item.get("mediaType")
                pieces.append(f"[{item.get('type', 'part')}{': ' + str(media) if media else ''}]")
        return "\n".join(pieces)
    if isinstance(value, str):
        return value
    return _json(value)


def render_part(part: Mapping[str, Any]) -> str:
    kind = part.get("type")
    if kind in ("text", "reasoning"):
        text = str(part.get("text", ""))
        return text if kind == "text" else f"[reasoning]\n{text}"
    if kind == "file":
        return f"[file {part.get('handle', '')}] {part.get('displayName', '')} ({part.get('mediaType', '')})"
    if kind == "tool-call":
        return f"[tool call {part.get('toolCallId', '')}] {part.get('toolName', '')} {_json(part.get('input'))}"
    if kind == "tool-result":
        output = part.get("output") or {}
        head = f"[tool result {part.get('toolCallId', '')}] {part.get('toolName', '')} ({output.get('type', '')})"
        return head + "\n" + _output_text(output)
    return _json(dict(part))


def render_transcript(rows: Sequence[Message]) -> str:
    """The transcript text of ``rows`` (outputs already resolved to their originals by the caller)."""
    out: list[str] = []
    for n, row in enumerate(rows, start=1):
        out.append(f"### [{n}] {row.get('role', '')} {row.get('id', '')}")
        out += [render_part(p) for p in row.get("parts") or []]
    return "\n".join(out) + "\n"
