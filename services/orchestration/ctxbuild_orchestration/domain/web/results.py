"""What a search answered, as citable results, pure: SearXNG's JSON, and an MCP search tool's output mapped best
effort (result objects under the usual keys, ``Title:/URL:/Content:`` records, else the text as one result).
The backends that ask are ``adapters/web/search.py``."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from ctxbuild_codec import extract_text

from .outputs import Entity, WebToolError

URL_KEYS = ("url", "link", "href", "uri")
TITLE_KEYS = ("title", "name", "heading")
CONTENT_KEYS = ("content", "snippet", "description", "text", "summary", "body", "raw_content")
LIST_KEYS = ("results", "items", "organic", "organic_results", "data", "hits")
# "Title: …" / "URL: …" / "Content: …" records, as text-only search servers (e.g. tavily-mcp) write them
_LABEL = re.compile(r"^(Title|URL|Link|Content|Snippet|Description|Raw Content)\s*:\s?(.*)$", re.IGNORECASE)


def _first_str(obj: Mapping[str, Any], keys: Iterable[str]) -> str | None:
    for k in keys:
        v = obj.get(k)
        if isinstance(v, str) and v.strip():
            return v.strip()
    return None


def entity_from_obj(obj: Any) -> Entity | None:
    """One result from a search API's result object; None when it carries neither a URL nor any text."""
    if isinstance(obj, str):
        return Entity(title="", url="", content=obj) if obj.strip() else None
    if not isinstance(obj, Mapping):
        return None
    url = _first_str(obj, URL_KEYS) or ""
    content = _first_str(obj, CONTENT_KEYS) or ""
    title = _first_str(obj, TITLE_KEYS) or url
    if not url and not content:
        return None
    return Entity(title=title, url=url, content=content)


def result_list(data: Any, depth: int = 1) -> list[Any] | None:
    """The list of results in a decoded search answer: the answer itself, or under a usual key (also one level
    down, as in ``{"web": {"results": […]}}``)."""
    if isinstance(data, list):
        return data
    if not isinstance(data, Mapping):
        return None
    for k in LIST_KEYS:
        if isinstance(data.get(k), list):
            return data[k]
    if depth:
        for v in data.values():
            if isinstance(v, Mapping) and (found := result_list(v, depth - 1)) is not None:
                return found
    return None


def entities_from_json(data: Any) -> list[Entity] | None:
    """Results from a decoded JSON answer; None when it does not look like search results."""
    items = result_list(data)
    if items is None:
        one = entity_from_obj(data) if isinstance(data, Mapping) and _first_str(data, URL_KEYS) else None
        return [one] if one else None
    return [e for e in map(entity_from_obj, items) if e is not None]


def entities_from_labelled_text(text: str) -> list[Entity]:
    """``Title: …``/``URL: …``/``Content: …`` records (continuation lines belong to the field above)."""
    out: list[dict[str, str]] = []
    cur: dict[str, str] | None = None
    field: str | None = None
    for line in text.splitlines():
        m = _LABEL.match(line.strip())
        if m:
            label = m.group(1).lower()
            field = "url" if label in ("url", "link") else "title" if label == "title" else "content"
            starts_new = cur is None or (field in ("title", "url") and field in cur) or \
                (field == "title" and "url" in cur)
            if starts_new:
                cur = {}
                out.append(cur)
            if field == "content" and cur.get("content"):
                cur["content"] += "\n" + m.group(2)
            else:
                cur[field] = m.group(2)
        elif cur is not None and field == "content" and line.strip():
            cur["content"] += "\n" + line
    return [Entity(title=r.get("title") or r.get("url", ""), url=r.get("url", ""),
                   content=r.get("content", "").strip()) for r in out if r.get("url")]


def entities_from_output(output: Mapping[str, Any], query: str) -> list[Entity]:
    """Results from an MCP tool output (SPEC §1 ToolOutput), best effort: structured content or JSON text with a
    result list; labelled text records; else the whole text as one result."""
    kind = output.get("type")
    if kind in ("error-text", "error-json"):
        raise WebToolError("search-failed", f"the search tool failed: {extract_text(output) or 'no details'}")
    candidates: list[Any] = []
    meta = output.get("metadata")
    if isinstance(meta, Mapping) and meta.get("structuredContent") is not None:
        candidates.append(meta["structuredContent"])
    if kind == "json":
        candidates.append(output.get("value"))
    text = extract_text(output) if kind in ("text", "content") else None
    if text:
        try:
            candidates.append(json.loads(text))
        except ValueError:
            pass
    for data in candidates:
        found = entities_from_json(data)
        if found is not None:
            return found
    if text is None:
        raise WebToolError("search-failed", f"the search tool returned a {kind!r} output, not results")
    labelled = entities_from_labelled_text(text)
    if labelled:
        return labelled
    return [Entity(title=f"Search results for {query!r}", url="", content=text)] if text.strip() else []


def searxng_entities(data: Any) -> list[Entity]:
    """The ``results`` of a SearXNG JSON answer (``url``, ``title``, ``content``); WebToolError if malformed."""
    if not isinstance(data, Mapping) or not isinstance(data.get("results"), list):
        raise WebToolError("search-failed", "SearXNG answered without a results list")
    out = []
    for r in data["results"]:
        if isinstance(r, Mapping) and isinstance(r.get("url"), str) and r["url"]:
            out.append(Entity(title=str(r.get("title") or r["url"]), url=r["url"],
                              content=r.get("content") if isinstance(r.get("content"), str) else ""))
    return out


