"""Start the MCP catalog: ``python -m ctxbuild_mcp_catalog``."""

from __future__ import annotations

import json
from typing import Any

from ctxbuild_platform.service import make_app, make_broker, serve
from faststream.asgi import AsgiResponse, get

from .catalog import Catalog
from .handlers import register
from .settings import Settings


def build(settings: Settings | None = None) -> tuple[Any, Settings, Catalog]:
    settings = settings or Settings()
    broker = make_broker(settings)
    catalog = Catalog(settings)
    register(broker, catalog, max_workers=settings.max_workers)

    @get(include_in_schema=False)
    async def servers(scope: Any) -> AsgiResponse:
        body = json.dumps({"servers": await catalog.status()}).encode()
        return AsgiResponse(body, 200, headers={"content-type": "application/json"})

    app = make_app(settings, broker,
                   readiness=[("mcp", catalog.ready)],
                   after_startup=[catalog.start],
                   on_shutdown=[catalog.close],
                   extra_routes=[("/mcp/servers", servers)])
    return app, settings, catalog


def create_app(settings: Settings | None = None) -> Any:
    """The app, for `make contracts` (AsyncAPI) and for tests; no connection is made until it starts."""
    return build(settings)[0]


def main() -> None:
    app, settings, _ = build()
    serve(app, settings)


if __name__ == "__main__":
    main()
