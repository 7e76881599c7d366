"""The web tools as the turn runner sees them: their ToolSpecs, which of them a deployment offers, and one facade
(``WebTools``) that validates the model's arguments and runs the tool."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
from ctxbuild_providers import ToolSpec

from .netguard import MAX_URL_CHARS
from .outputs import WebToolError, error_output
from .settings import WebToolSettings
from .web_fetch import make_client, web_fetch
from .web_search import Invoke, McpSearchBackend, SearchBackend, SearxngBackend, web_search

MAX_QUERY_CHARS = 500
MAX_RESULTS = 20

WEB_FETCH = ToolSpec(
    name="web_fetch",
    description="Fetch a web page (http/https) and return its readable text with its title and final URL. "
                "Reads HTML, plain text and JSON; cite the result by its id.",
    input_schema={
        "type": "object",
        "properties": {
            "url": {"type": "string", "description": "absolute http(s) URL", "maxLength": MAX_URL_CHARS},
        },
        "required": ["url"],
        "additionalProperties": False,
    },
)
WEB_SEARCH = ToolSpec(
    name="web_search",
    description="Search the web. Returns results with id, title, url and a content snippet; cite them by id "
                "and read a page in full with web_fetch.",
    input_schema={
        "type": "object",
        "properties": {
            "query": {"type": "string", "minLength": 1, "maxLength": MAX_QUERY_CHARS},
            "maxResults": {"type": "integer", "minimum": 1, "maximum": MAX_RESULTS,
                           "description": "how many results (default set by the deployment)"},
        },
        "required": ["query"],
        "additionalProperties": False,
    },
)
SPECS = {WEB_FETCH.name: WEB_FETCH, WEB_SEARCH.name: WEB_SEARCH}


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


def available_web_tools(settings: WebToolSettings, *, mcp_invoke_available: bool = False) -> list[str]:
    """Names of the web tools these settings offer: web_fetch unless disabled; web_search only with a backend."""
    names = ["web_fetch"] if settings.web_fetch_enabled else []
    if settings.searxng_url or (settings.search_mcp_tool and mcp_invoke_available):
        names.append("web_search")
    return names


def _check_args(args: Any, schema: Mapping[str, Any]) -> dict[str, Any]:
    """The model's arguments against one of the schemas above (flat objects of strings and integers)."""
    if not isinstance(args, Mapping):
        raise WebToolError("invalid-input", "arguments must be a JSON object")
    props = schema["properties"]
    extra = sorted(set(args) - set(props))
    if extra:
        raise WebToolError("invalid-input", f"unknown argument(s) {extra}; allowed: {sorted(props)}")
    for name in schema["required"]:
        if name not in args:
            raise WebToolError("invalid-input", f"missing required argument {name!r}")
    for name, value in args.items():
        rule = props[name]
        if rule["type"] == "string":
            if not isinstance(value, str):
                raise WebToolError("invalid-input", f"{name} must be a string")
            if len(value.strip()) < rule.get("minLength", 0):
                raise WebToolError("invalid-input", f"{name} must not be empty")
            if len(value) > rule.get("maxLength", len(value)):
                raise WebToolError("invalid-input", f"{name} is longer than {rule['maxLength']} characters")
        elif rule["type"] == "integer":
            if isinstance(value, bool) or not isinstance(value, int):
                raise WebToolError("invalid-input", f"{name} must be an integer")
            if not rule.get("minimum", value) <= value <= rule.get("maximum", value):
                raise WebToolError("invalid-input",
                                   f"{name} must be between {rule['minimum']} and {rule['maximum']}")
    return dict(args)


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
