"""Settings of the web tools. Plain pydantic fields with defaults, meant to be mixed into the service's
``Settings`` (env prefix ``CTX_``): ``class Settings(ServiceSettings, WebToolSettings)``."""

from __future__ import annotations

from pydantic import BaseModel, Field

DEFAULT_USER_AGENT = "ctxbuild-web/0.1 (+https://github.com/ctxbuild; web_fetch)"


class WebToolSettings(BaseModel):
    web_fetch_enabled: bool = Field(True, description="offer web_fetch to the model")
    allow_private_networks: bool = Field(
        False, description="let web_fetch reach private, loopback and link-local addresses (SSRF guard off)")
    fetch_max_bytes: int = Field(5_000_000, ge=1_024, description="web_fetch reads at most this many body bytes")
    fetch_timeout_s: float = Field(20.0, gt=0, description="web_fetch: whole download, redirects included")
    fetch_max_redirects: int = Field(5, ge=0, le=20)
    user_agent: str = DEFAULT_USER_AGENT
    searxng_url: str | None = Field(None, description="SearXNG base URL (JSON API); enables web_search")
    search_mcp_tool: str | None = Field(
        None, description="catalog id of an MCP search tool (e.g. mcp__tavily__tavily_search); enables web_search "
                          "when no SearXNG is set")
    search_mcp_query_arg: str = Field("query", description="the MCP search tool's argument for the query")
    search_mcp_max_results_arg: str | None = Field(
        None, description="the MCP search tool's argument for the number of results, if it has one")
    search_timeout_s: float = Field(15.0, gt=0)
    search_max_results: int = Field(5, ge=1, le=20, description="results when the model does not ask for a number")
