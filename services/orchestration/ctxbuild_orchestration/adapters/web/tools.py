"""The web tools as the turn runner holds them: one facade (``WebTools``) that validates the model's arguments and
runs the tool, and the search backend the settings choose."""

from __future__ import annotations

from typing import Any

import httpx
from ctxbuild_providers import ToolSpec

from ...domain.web.outputs import WebToolError, error_output
from ...domain.web.settings import WebToolSettings
from ...domain.web.specs import SPECS, _check_args
from .fetch import make_client, web_fetch
from .search import Invoke, McpSearchBackend, SearchBackend, SearxngBackend, web_search


def search_backend(settings: WebToolSettings, mcp_invoke: Invoke | None = None) -> SearchBackend | None:
    """SearXNG when its URL is set, else the configured MCP search tool (when the catalog can be called)."""
    if settings.searxng_url:
        return SearxngBackend(settings.searxng_url, timeout=settings.search_timeout_s,
                              user_agent=settings.user_agent)
    if settings.search_mcp_tool and mcp_invoke is not None:
        return McpSearchBackend(mcp_invoke, settings.search_mcp_tool, settings.search_mcp_query_arg,
                                max_results_arg=settings.search_mcp_max_results_arg,
                                timeout=settings.search_timeout_s)
    return None


class WebTools:
    """What the runner holds: ``specs()`` to offer, ``await execute(name, args)`` to run (None: not a web tool).

    One HTTP client for all fetches of the process (connection reuse, one TLS context); ``aclose()`` at shutdown.
    """

    def __init__(self, settings: WebToolSettings, *, mcp_invoke: Invoke | None = None,
                 backend: SearchBackend | None = None) -> None:
        self.settings = settings
        self.backend = backend if backend is not None else search_backend(settings, mcp_invoke)
        self._client: httpx.AsyncClient | None = None

    def available(self) -> list[str]:
        names = ["web_fetch"] if self.settings.web_fetch_enabled else []
        return names + (["web_search"] if self.backend is not None else [])

    def specs(self) -> list[ToolSpec]:
        return [SPECS[n] for n in self.available()]

    def _fetch_client(self) -> httpx.AsyncClient:
        if self._client is None:
            s = self.settings
            self._client = make_client(allow_private_networks=s.allow_private_networks, user_agent=s.user_agent,
                                       max_redirects=s.fetch_max_redirects)
        return self._client

    async def execute(self, name: str, args: Any) -> dict[str, Any] | None:
        if name not in SPECS:
            return None
        if name not in self.available():
            return error_output("unavailable", f"{name} is not enabled in this deployment")
        try:
            checked = _check_args(args, SPECS[name].input_schema)
        except WebToolError as exc:
            return exc.output()
        s = self.settings
        if name == "web_fetch":
            return await web_fetch(checked["url"], max_bytes=s.fetch_max_bytes, timeout=s.fetch_timeout_s,
                                   client=self._fetch_client())
        assert self.backend is not None
        return await web_search(checked["query"].strip(), backend=self.backend,
                                max_results=checked.get("maxResults", s.search_max_results))

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self.backend is not None and hasattr(self.backend, "aclose"):
            await self.backend.aclose()
