"""Tool ids (SPEC §11): ``mcp__<serverSlug>__<toolSlug>_<first 20 hex of sha256(serverId \\0 toolName)>``.

At most 63 chars and always matching ``^[a-z0-9_]+$`` — valid as a function name on every provider's wire.
The hash part makes the id unique per (server, tool) whatever the slugs lose; the slugs only make it readable.
The server slug is capped at a fixed length, so every tool of one server shares the prefix
``mcp__<serverSlug>__`` (:func:`server_prefix`), which is how an id is routed back to its server.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

MAX_ID_LEN = 63
HASH_LEN = 20
SERVER_SLUG_MAX = 16
PREFIX = "mcp__"
# "mcp__" + "__" + "_" + 20 hex = 28 fixed chars → 35 for both slugs
SLUG_BUDGET = MAX_ID_LEN - len(PREFIX) - 2 - 1 - HASH_LEN

_NON_ALNUM = re.compile(r"[^a-z0-9]+")
TOOL_ID_RE = re.compile(r"^mcp__[a-z0-9_]+__[a-z0-9_]+_[0-9a-f]{20}$")


def slugify(text: str, max_len: int, fallback: str) -> str:
    """ASCII-fold, lower-case, every run of other characters → one ``_``; never empty, never ``_``-edged.

    Runs collapse so a slug never contains ``__`` (the id's separator)."""
    folded = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii").lower()
    slug = _NON_ALNUM.sub("_", folded).strip("_")[:max_len].rstrip("_")
    return slug or fallback[:max_len]


def server_slug(server_label: str) -> str:
    return slugify(server_label, SERVER_SLUG_MAX, "server")


def server_prefix(server_label: str) -> str:
    return f"{PREFIX}{server_slug(server_label)}__"


def tool_hash(server_id: str, tool_name: str) -> str:
    return hashlib.sha256(f"{server_id}\0{tool_name}".encode()).hexdigest()[:HASH_LEN]


def tool_id(server_id: str, tool_name: str, server_label: str | None = None) -> str:
    """The id of ``tool_name`` on server ``server_id``; the server slug is made from ``server_label``
    (the server's display name) when given, else from its id. The hash always uses the id."""
    s = server_slug(server_label if server_label is not None else server_id)
    t = slugify(tool_name, SLUG_BUDGET - len(s), "tool")
    out = f"{PREFIX}{s}__{t}_{tool_hash(server_id, tool_name)}"
    assert len(out) <= MAX_ID_LEN, out
    return out


def looks_like_tool_id(value: str) -> bool:
    return len(value) <= MAX_ID_LEN and TOOL_ID_RE.match(value) is not None


def servers_for_id(value: str, servers: dict[str, str]) -> list[str]:
    """Server ids (from ``{server_id: label}``) whose tools could carry the id ``value`` (prefix match)."""
    return [sid for sid, label in servers.items() if value.startswith(server_prefix(label))]
