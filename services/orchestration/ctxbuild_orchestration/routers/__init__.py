"""The HTTP/SSE edge (FastAPI), one router per resource. Thin: parse, call the edge's use cases (app/edge.py),
encode; typed service errors are mapped to HTTP by errors.py."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from ..app.edge import Edge
from . import conversations, keys, messages, turns
from .common import ERRORS, body_limited_route, caller
from .errors import install_error_handlers

__all__ = ["build_api", "install_error_handlers"]


def build_api(edge: Edge, sse_poll_s: float) -> APIRouter:
    """``/v1``: every route authenticates first (the route class) and reads a limited body."""
    route_class = body_limited_route(edge.limits, edge.auth)
    api = APIRouter(prefix="/v1", route_class=route_class, responses=ERRORS, dependencies=[Depends(caller)])
    api.include_router(conversations.router(edge, route_class))
    api.include_router(turns.router(edge, route_class, sse_poll_s))
    api.include_router(messages.router(edge, route_class))
    api.include_router(keys.router(edge, route_class))
    return api
