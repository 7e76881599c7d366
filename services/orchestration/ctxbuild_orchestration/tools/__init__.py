"""Built-in web tools of the turn runner: web_fetch and web_search (issue #9, SPEC §4 entities codec)."""

from .netguard import BlockedAddress, GuardedBackend, GuardedTransport, blocked_reason, validate_url
from .outputs import Entity, WebToolError, entities_output, entity_prefix, error_output
from .settings import DEFAULT_USER_AGENT, WebToolSettings
from .specs import SPECS, WEB_FETCH, WEB_SEARCH, WebTools, available_web_tools, search_backend
from .web_fetch import Page, extract_html, make_client, media_kind, readable, web_fetch
from .web_search import (
    McpSearchBackend,
    SearchBackend,
    SearxngBackend,
    entities_from_output,
    searxng_entities,
    web_search,
)

__all__ = [
    "DEFAULT_USER_AGENT", "SPECS", "WEB_FETCH", "WEB_SEARCH", "BlockedAddress", "Entity", "GuardedBackend",
    "GuardedTransport", "McpSearchBackend", "Page", "SearchBackend", "SearxngBackend", "WebToolError",
    "WebToolSettings", "WebTools", "available_web_tools", "blocked_reason", "entities_from_output",
    "entities_output", "entity_prefix", "error_output", "extract_html", "make_client", "media_kind", "readable",
    "search_backend", "searxng_entities", "validate_url", "web_fetch", "web_search",
]
