"""Built-in web tools of the turn runner: web_fetch and web_search (issue #9, SPEC §4 entities codec). The pure
parts (pages, search results, specs, outputs) are ``domain/web/``; this package fetches, searches and runs them."""

from ...domain.web.outputs import Entity, WebToolError, entities_output, entity_prefix, error_output
from ...domain.web.pages import Page, extract_html, media_kind, readable
from ...domain.web.results import entities_from_output, searxng_entities
from ...domain.web.settings import DEFAULT_USER_AGENT, WebToolSettings
from ...domain.web.specs import SPECS, WEB_FETCH, WEB_SEARCH, available_web_tools
from .fetch import make_client, web_fetch
from .netguard import BlockedAddress, GuardedBackend, GuardedTransport, blocked_reason, validate_url
from .search import McpSearchBackend, SearchBackend, SearxngBackend, web_search
from .tools import WebTools, search_backend

__all__ = [
    "DEFAULT_USER_AGENT", "SPECS", "WEB_FETCH", "WEB_SEARCH", "BlockedAddress", "Entity", "GuardedBackend",
    "GuardedTransport", "McpSearchBackend", "Page", "SearchBackend", "SearxngBackend", "WebToolError",
    "WebToolSettings", "WebTools", "available_web_tools", "blocked_reason", "entities_from_output",
    "entities_output", "entity_prefix", "error_output", "extract_html", "make_client", "media_kind", "readable",
    "search_backend", "searxng_entities", "validate_url", "web_fetch", "web_search",
]
