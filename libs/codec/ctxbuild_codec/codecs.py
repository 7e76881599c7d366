"""Codecs (SPEC §4): split a structured tool output into a skeleton and trimmable text blobs, and back.

- ``deflate(codec, value) → Deflated(skeleton, blobs) | None``: the skeleton is the value itself (nothing is
  copied); each blob names one large text field by a JSON-pointer-lite key and carries its text.
- ``assemble(skeleton, texts) → value``: puts ``texts[key]`` at each key. Containers on the way are shallow
  clones with their key insertion order kept, so the result serialises byte-identically to the original except at
  the replaced fields; untouched branches (and the whole value, when nothing changes) are the same objects.
- ``extract_text(output)``: the opaque lane's text of a tool output (no codec, or the codec does not apply).

Keys are stored in envelopes, so a value can be re-assembled later without knowing which codec made it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NamedTuple

_tuple_new = tuple.__new__
ENTITIES = "entities"
TEXT_FIELD = "text-field"
ERROR_TYPES = frozenset({"error-text", "error-json"})
SNIPPET_CHARS = 300


class Blob(NamedTuple):
    key: str
    text: str


class Deflated(NamedTuple):
    skeleton: Any
    blobs: list[Blob]


# ---------- JSON-pointer-lite keys ----------

def escape(segment: str) -> str:
    """RFC 6901 escaping of one key segment (``~`` → ``~0``, ``/`` → ``~1``)."""
    return segment.replace("~", "~0").replace("/", "~1") if ("~" in segment or "/" in segment) else segment


def unescape(segment: str) -> str:
    return segment.replace("~1", "/").replace("~0", "~") if "~" in segment else segment


def pointer(*segments: str | int) -> str:
    """``pointer(3, "content") == "/3/content"``; ``pointer() == ""`` (the whole value)."""
    return "".join("/" + escape(str(s)) for s in segments)


def split_key(key: str) -> list[str]:
    if key == "":
        return []
    if key[0] != "/":
        raise ValueError(f"not a JSON-pointer-lite key: {key!r}")
    segs = key[1:].split("/")
    return [unescape(s) for s in segs] if "~" in key else segs


def get_at(value: Any, key: str) -> Any:
    """The value at ``key``; KeyError if the path does not exist."""
    node = value
    for seg in split_key(key):
        if type(node) is list:
            i = _index(seg, len(node))
            if i is None:
                raise KeyError(key)
            node = node[i]
        elif type(node) is dict and seg in node:
            node = node[seg]
        else:
            raise KeyError(key)
    return node


def _index(seg: str, n: int) -> int | None:
    if not seg.isdigit() or (len(seg) > 1 and seg[0] == "0"):  # canonical decimal indexes only
        return None
    i = int(seg)
    return i if i < n else None


# ---------- assemble ----------

class _Leaf(tuple):
    """A replacement value in the assemble trie (a 1-tuple: cheap to make, told apart from branch dicts)."""

    __slots__ = ()


def assemble(skeleton: Any, texts: Mapping[str, Any]) -> Any:
    """``skeleton`` with ``texts[key]`` at each key (shallow clones, key order kept; see module doc).

    A key whose path does not exist is ignored; a key whose value is already equal changes nothing; a key
    under another key that is replaced whole is moot.
    """
    if not texts:
        return skeleton
    if type(skeleton) is list:
        out = _assemble_items(skeleton, texts)
        if out is not _GENERIC:
            return out
    trie: dict[str, Any] = {}
    for key, text in texts.items():
        if not key:
            return skeleton if skeleton == text else text  # the whole value ("" key) wins over field keys
        if key[0] != "/":
            raise ValueError(f"not a JSON-pointer-lite key: {key!r}")
        segs = key[1:].split("/")
        if "~" in key:
            segs = [unescape(s) for s in segs]
        node = trie
        for seg in segs[:-1]:
            nxt = node.get(seg)
            if nxt is None:
                nxt = node[seg] = {}
            elif type(nxt) is _Leaf:
                break  # a prefix of this key is replaced whole: nothing below it to set
            node = nxt
        else:
            node[segs[-1]] = _Leaf((text,))
    return _apply(skeleton, trie)


_GENERIC = object()


def _assemble_items(items: list[Any], texts: Mapping[str, Any]) -> Any:
    """assemble() for the shape every entities output has — only ``/<i>/<field>`` keys into a list of objects —
    without building a trie; the same result as the generic path (``_GENERIC`` when a key is not of that shape)."""
    out = None
    n = len(items)
    for key, text in texts.items():
        parts = key.split("/")
        if len(parts) != 3 or parts[0] or "~" in key:
            return _GENERIC
        seg, field = parts[1], parts[2]
        if not seg.isdigit() or (seg[0] == "0" and len(seg) > 1):
            continue
        i = int(seg)
        if i >= n:
            continue
        src = items[i] if out is None else out[i]
        if type(src) is not dict:
            if type(src) is list:
                return _GENERIC
            continue
        if field not in src:
            continue
        child = src[field]
        if child is text or (type(child) is type(text) and child == text):
            continue
        if out is None:
            out = items.copy()
        if src is items[i]:
            src = src.copy()  # keeps insertion order; the assignment below keeps the field's position
            out[i] = src
        src[field] = text
    return items if out is None else out


def _apply(node: Any, trie: dict[str, Any]) -> Any:
    in_list = type(node) is list
    if not in_list and type(node) is not dict:
        return node
    n = len(node)
    out = None
    for seg, sub in trie.items():
        if in_list:  # _index written out: this loop runs once per replaced field
            if not seg.isdigit() or (seg[0] == "0" and len(seg) > 1) or (key := int(seg)) >= n:
                continue
        elif seg in node:
            key = seg
        else:
            continue
        child = node[key]
        if type(sub) is _Leaf:
            new = sub[0]
            if new is child or (type(child) is type(new) and child == new):
                continue
        else:
            new = _apply(child, sub)
            if new is child:
                continue
        if out is None:
            out = node.copy()  # dict.copy keeps insertion order; assignment keeps the key's position
        out[key] = new
    return node if out is None else out


# ---------- the codecs ----------

class EntitiesCodec:
    """``[{id, title, url, content}, …]``: a non-empty array of plain objects, each with a string content field.

    One blob per item at ``/<i>/<content key>``; every other field (the citation identity) stays in the skeleton.
    """

    name = ENTITIES

    def __init__(self, content_key: str = "content") -> None:
        self.content_key = content_key
        self._suffix = "/" + escape(content_key)

    def deflate(self, value: Any) -> Deflated | None:
        if type(value) is not list or not value:
            return None
        ck, suffix = self.content_key, self._suffix
        blobs = []
        append = blobs.append
        for i, item in enumerate(value):
            if type(item) is not dict:
                return None
            text = item.get(ck)
            if type(text) is not str:
                return None
            append(_tuple_new(Blob, (f"/{i}{suffix}", text)))  # Blob(key, text) without a __new__ frame
        return Deflated(value, blobs)


class TextFieldCodec:
    """A plain object with one large string field (read-tool echoes): one blob at ``/<text key>``."""

    name = TEXT_FIELD

    def __init__(self, text_key: str = "text") -> None:
        self.text_key = text_key
        self._key = pointer(text_key)

    def deflate(self, value: Any) -> Deflated | None:
        if type(value) is not dict:
            return None
        text = value.get(self.text_key)
        if type(text) is not str:
            return None
        return Deflated(value, [Blob(self._key, text)])


CODECS: dict[str, EntitiesCodec | TextFieldCodec] = {
    ENTITIES: EntitiesCodec("content"),
    TEXT_FIELD: TextFieldCodec("text"),
}


def deflate(codec: str, value: Any) -> Deflated | None:
    """Deflate ``value`` with the named codec; None when the value does not have the codec's shape."""
    return CODECS[codec].deflate(value)


def inflate_value(skeleton: Any, blobs: list[Blob] | Mapping[str, str]) -> Any:
    """The inverse of deflate: ``inflate_value(d.skeleton, d.blobs) == value``."""
    texts = blobs if isinstance(blobs, Mapping) else {b.key: b.text for b in blobs}
    return assemble(skeleton, texts)


# ---------- opaque lane ----------

def compact_json(value: Any) -> str:
    """The opaque text of a structured output: compact JSON, non-ASCII kept as is."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def content_texts(blocks: Any) -> list[str]:
    """The non-empty texts of an MCP content array's text blocks, in order."""
    if type(blocks) is not list:
        return []
    out = []
    for b in blocks:
        if isinstance(b, Mapping) and b.get("type") == "text":
            t = b.get("text")
            if type(t) is str and t:
                out.append(t)
    return out


def extract_text(output: Mapping[str, Any]) -> str | None:
    """Opaque-lane text of a tool output (§4); None when it is not ours to trim (``persisted``, unknown type).

    ``text``/``error-text`` as is, ``json``/``error-json`` as compact JSON, MCP ``content`` text blocks joined
    with ``\\n`` (empty ones dropped; images and other media are not text).
    """
    kind = output.get("type")
    value = output.get("value")
    if kind == "text" or kind == "error-text":
        return value if type(value) is str else ""
    if kind == "json" or kind == "error-json":
        return compact_json(value)
    if kind == "content":
        return "\n".join(content_texts(value))
    return None


def is_error(output: Mapping[str, Any]) -> bool:
    return output.get("type") in ERROR_TYPES


def snippet(text: str) -> str:
    """Stripped text; longer than 300 chars → the first 300 + ``…`` (what a v2 skeleton keeps in place)."""
    s = text.strip()
    return s if len(s) <= SNIPPET_CHARS else s[:SNIPPET_CHARS] + "…"
