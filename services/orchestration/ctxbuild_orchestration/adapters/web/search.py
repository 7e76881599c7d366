"""web_search: a query → citable results, through a pluggable backend.

- ``SearxngBackend``: SearXNG's JSON API (``GET /search?q=…&format=json``; the instance must list ``json`` in
  ``search.formats``, else it answers 403).
- ``McpSearchBackend``: an MCP search tool run through the catalog (``invoke(tool_id, args) -> tool output``);
  its output is mapped to results best effort.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import httpx

from ...domain.web.outputs import Entity, WebToolError, entities_output
from ...domain.web.results import entities_from_output, searxng_entities
from ...domain.web.settings import DEFAULT_USER_AGENT

# (tool id, arguments) → the tool output, or the ctx.mcp.invoke reply that carries it
Invoke = Callable[[str, dict[str, Any]], Awaitable[Mapping[str, Any]]]


@runtime_checkable
class SearchBackend(Protocol):
    name: str

    async def search(self, query: str, max_results: int) -> list[Entity]:
        """Results in rank order, at most ``max_results``; WebToolError on failure."""
        ...


# ---------- backends ----------

class SearxngBackend:
    name = "searxng"

    def __init__(self, base_url: str, *, timeout: float = 15.0, user_agent: str = DEFAULT_USER_AGENT,
                 client: httpx.AsyncClient | None = None) -> None:
        self.endpoint = base_url.rstrip("/") + "/search"
        self.timeout = timeout
        # the operator's own instance, often on a private network: not behind web_fetch's SSRF guard
        self.client = client or httpx.AsyncClient(headers={"User-Agent": user_agent, "Accept": "application/json"})

    async def search(self, query: str, max_results: int) -> list[Entity]:
        try:
            resp = await self.client.get(self.endpoint, params={"q": query, "format": "json"},
                                         timeout=self.timeout)
        except httpx.TimeoutException:
            raise WebToolError("timeout", f"SearXNG did not answer within {self.timeout:g}s") from None
        except httpx.HTTPError as exc:
            raise WebToolError("search-failed", f"SearXNG unreachable: {str(exc) or type(exc).__name__}") from None
        if resp.status_code >= 400:
            hint = " (is 'json' in search.formats of its settings.yml?)" if resp.status_code == 403 else ""
            raise WebToolError(f"http-{resp.status_code}", f"SearXNG answered HTTP {resp.status_code}{hint}")
        try:
            data = resp.json()
        except ValueError:
            raise WebToolError("search-failed", "SearXNG answered with something that is not JSON") from None
        return searxng_entities(data)[:max_results]

    async def aclose(self) -> None:
        await self.client.aclose()


class McpSearchBackend:
    name = "mcp"

    def __init__(self, invoke: Invoke, tool_id: str, query_arg: str = "query", *,
                 max_results_arg: str | None = None, extra_args: Mapping[str, Any] | None = None,
                 timeout: float = 15.0) -> None:
        self.invoke = invoke
        self.tool_id = tool_id
        self.query_arg = query_arg
        self.max_results_arg = max_results_arg
        self.extra_args = dict(extra_args or {})
        self.timeout = timeout

    async def search(self, query: str, max_results: int) -> list[Entity]:
        try:
            async with asyncio.timeout(self.timeout):
                args = {**self.extra_args, self.query_arg: query}
                if self.max_results_arg:
                    args[self.max_results_arg] = max_results
                output = await self.invoke(self.tool_id, args)
        except TimeoutError:
            raise WebToolError("timeout", f"{self.tool_id} did not answer within {self.timeout:g}s") from None
        except Exception as exc:  # noqa: BLE001 — whatever the catalog raises, the model gets a typed error
            code = getattr(exc, "code", None)
            detail = getattr(exc, "remote_message", None) or str(exc) or type(exc).__name__
            raise WebToolError("search-failed", f"{self.tool_id}: {f'{code}: ' if code else ''}{detail}") from None
        if isinstance(output, Mapping) and "type" not in output and isinstance(output.get("output"), Mapping):
            output = output["output"]  # the ctx.mcp.invoke reply as it comes: {output, timedOut?, cancelled?}
        if not isinstance(output, Mapping) or "type" not in output:
            raise WebToolError("search-failed", f"{self.tool_id} returned no tool output")
        return entities_from_output(output, query)[:max_results]

    async def aclose(self) -> None:
        return None


async def web_search(query: str, *, backend: SearchBackend, max_results: int) -> dict[str, Any]:
    """``{"type": "json", "value": [{id, title, url, content}, …]}`` (ids ``<8 random>-<n>``, n from 1) or a
    ``[Error: <code>] …`` error-text."""
    try:
        found = await backend.search(query, max_results)
    except WebToolError as exc:
        return exc.output()
    return entities_output(found[:max_results])
