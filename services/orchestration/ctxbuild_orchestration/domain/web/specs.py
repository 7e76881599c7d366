"""The web tools as the model sees them, pure: their ToolSpecs, which of them a deployment offers, and the check of
the model's arguments against their schemas. Running them is ``adapters/web/tools.py``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ctxbuild_providers import ToolSpec

from .outputs import WebToolError
from .settings import WebToolSettings

MAX_URL_CHARS = 8_192
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
