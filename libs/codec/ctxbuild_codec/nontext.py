"""Non-text tool outputs (SPEC §15.1): the original output kept whole in the blob store, a marker per non-text part.

A ``content`` output (MCP blocks) can hold more than its text blocks: images, audio, embedded resources, resource
links, text blocks with annotations, and ``metadata`` (``structuredContent``). The text lanes only cut the joined
text, so when such an output is trimmed or offloaded, both lanes also store the **original output** as one blob:
its JSON (``original_text``: indented, so fs_read pages it; ``ctx.blob.get_result`` parses it back to the exact
output), and the model sees, after the text (or its marker), one marker per non-text part naming its kind, media
type, size and the original's URI. A ``json`` / ``error-json`` output needs no second blob: its offloaded text is
already the compact JSON of its value, so the original names that same blob with ``of: value``.

The record of the original (``offload.original`` in flight, ``original`` in a v1 envelope) holds the descriptors
the markers are rendered from, so rendering is a pure function of stored fields (invariant 3).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .codecs import compact_json

OF_OUTPUT = "output"  # the blob is the whole output's compact JSON ({type, value, metadata?})
OF_VALUE = "value"    # the blob is the compact JSON of a json / error-json output's value (its offloaded text)
MAX_MARKERS = 8       # a flood of tiny blocks gets one summary line past this many markers
_FIELD_CHARS = 200    # names and URIs shown in a marker are capped (they come from the tool)
_PLAIN_TEXT_KEYS = ("type", "text")


def is_plain_text_block(block: Any) -> bool:
    """A text block with nothing beyond its text: the joined text is all there is of it."""
    return type(block) is dict and block.get("type") == "text" and type(block.get("text")) is str \
        and all(k in _PLAIN_TEXT_KEYS for k in block)


def has_nontext(output: Mapping[str, Any]) -> bool:
    """A ``content`` output with anything its joined text does not hold (other blocks, block fields, metadata)."""
    if output.get("type") != "content":
        return False
    blocks = output.get("value")
    if type(blocks) is not list:
        return False
    return "metadata" in output or not all(is_plain_text_block(b) for b in blocks)


def original_text(output: Mapping[str, Any]) -> str:
    """The blob of an original output: its JSON, key order kept, non-ASCII as is, one value per line (indent 1)
    so fs_read can page it by lines (compact JSON is a single line, over any page cap). Parsing it gives the
    output back exactly: ``compact_json(read_back(...)) == compact_json(output)``."""
    return json.dumps(output, ensure_ascii=False, indent=1)


def base64_bytes(data: Any) -> int | None:
    """Decoded size of base64 data without decoding it (None when it is not a string)."""
    if type(data) is not str:
        return None
    s = data.rstrip("=\n\r ")
    return len(s) * 3 // 4


def _capped(value: str) -> str:
    return value if len(value) <= _FIELD_CHARS else value[:_FIELD_CHARS - 1] + "…"


def _shown(value: Any) -> str:
    """A tool-supplied field on one line in a marker: JSON-quoted (newlines escaped)."""
    return json.dumps(value, ensure_ascii=False)


def describe(output: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One descriptor per part the joined text does not show, in order: each non-text block (and each text block
    with extra fields), then ``structuredContent`` / other metadata. Only what a marker names is kept here — the
    data itself is in the original blob."""
    blocks = output.get("value") if type(output.get("value")) is list else []
    n = len(blocks)
    out: list[dict[str, Any]] = []
    for i, b in enumerate(blocks):
        if is_plain_text_block(b):
            continue
        kind = b.get("type") if isinstance(b, Mapping) and type(b.get("type")) is str else "unknown"
        d: dict[str, Any] = {"type": kind, "block": i, "blocks": n}
        if not isinstance(b, Mapping):
            out.append(d)
            continue
        res = b.get("resource") if kind == "resource" and isinstance(b.get("resource"), Mapping) else b
        if type(res.get("mimeType")) is str:
            d["mimeType"] = _capped(res["mimeType"])
        if kind in ("resource", "resource_link") and type(res.get("uri")) is str:
            d["uri"] = _capped(res["uri"])
        if kind == "resource_link" and type(b.get("name")) is str:
            d["name"] = _capped(b["name"])
        if type(res.get("text")) is str:
            d["chars"] = len(res["text"])
        size = base64_bytes(res.get("data") if "data" in res else res.get("blob"))
        if size is None and type(res.get("size")) is int:
            size = res["size"]
        if size is not None:
            d["bytes"] = size
        out.append(d)
    meta = output.get("metadata")
    if isinstance(meta, Mapping):
        for key, value in meta.items():
            if key == "structuredContent":
                out.append({"type": "structuredContent", "chars": len(compact_json(value))})
            else:
                out.append({"type": "metadata", "key": _capped(str(key)), "chars": len(compact_json(value))})
    return out


def _what(d: Mapping[str, Any]) -> str:
    kind = d["type"]
    if kind in ("structuredContent", "metadata"):
        label = "structuredContent" if kind == "structuredContent" else f"metadata {_shown(d.get('key', ''))}"
        return f"{label} not shown ({d.get('chars', 0)} chars of JSON)"
    details = [f"content block {d['block'] + 1} of {d['blocks']}"]
    for field in ("name", "uri"):
        if field in d:
            details.append(f"{field} {_shown(d[field])}")
    if "mimeType" in d:
        details.append(_shown(d["mimeType"])[1:-1])
    if "bytes" in d:
        details.append(f"{d['bytes']} bytes")
    if "chars" in d:
        details.append(f"{d['chars']} chars")
    return f"{kind} not shown ({', '.join(details)})"


def render_markers(parts: Sequence[Mapping[str, Any]], uri: str | None) -> list[str]:
    """One marker per non-text part (the style of ``trim.render_marker``, kept short: each one follows the
    text's own marker); ``uri=None``: the original is gone."""
    where = f"Original output (all blocks and structuredContent, as JSON; fs_read reads it): {uri}\n" \
        if uri is not None else "Original output no longer available (the archived copy was deleted).\n"
    out = [f"<persisted-output>\n{_what(d)}\n{where}</persisted-output>" for d in parts[:MAX_MARKERS]]
    if len(parts) > MAX_MARKERS:
        out.append(f"<persisted-output>\n{len(parts) - MAX_MARKERS} more non-text parts not shown\n{where}"
                   "</persisted-output>")
    return out


def render_with_markers(text: str, parts: Sequence[Mapping[str, Any]], uri: str | None) -> str:
    """What the model sees of an output with non-text parts: its text (or text marker), then their markers."""
    return "\n\n".join([p for p in (text, *render_markers(parts, uri)) if p]).strip()


def read_back(of: str, output_type: str, blob_text: str) -> dict[str, Any]:
    """The original output from its blob: the stored output itself (``of: output``) or the json value's text
    (``of: value``). Parsed with the stdlib (big integers stay exact), so re-encoding gives the same bytes."""
    value = json.loads(blob_text)
    if of == OF_OUTPUT:
        return value
    return {"type": output_type, "value": value}
