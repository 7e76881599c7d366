"""Start the MCP catalog: ``python -m ctxbuild_mcp_catalog``.

Start-up: migrate the registry schema and seed it from CTX_MCP_SERVERS and load tool_search's embedding model
(before the broker subscribes), then subscribe, then prewarm the active servers in the background. The KV buckets
are bound on first use.
"""

from __future__ import annotations

import json
from typing import Any

import structlog
from ctxbuild_platform import claims
from ctxbuild_platform.service import entry_points, make_app, make_broker
from faststream.asgi import AsgiResponse, get

from .adapters.notifications import make_publisher
from .adapters.registry import Registry, apply_migrations
from .adapters.tool_cache import KvBuckets, KvRunLedger, KvToolCache, KvTurnStore
from .app import Catalog
from .handlers import register
from .settings import Settings

log = structlog.get_logger("mcp_catalog")


def build(settings: Settings) -> Any:
    broker = make_broker(settings)
    url = str(settings.database_url)
    registry = Registry(url, min_size=settings.db_pool_min, max_size=settings.db_pool_max,
                        timeout=settings.db_timeout_s)
    buckets = KvBuckets(lambda: broker.connection, tools=settings.kv_tools_bucket,
                        leases=settings.kv_leases_bucket, turns=settings.kv_turns_bucket,
                        lease_ttl_s=max(settings.lease_ttl_s, settings.server_start_timeout_s + 5),
                        turn_ttl_s=settings.turn_ttl_s, replicas=settings.kv_replicas)
    catalog = Catalog(settings, registry, KvToolCache(buckets), KvTurnStore(buckets),
                      publish=make_publisher(broker),
                      runs=KvRunLedger(buckets, lambda: claims.store(broker.connection)))
    register(broker, catalog, max_workers=settings.max_workers)

    async def open_registry() -> None:
        applied = await apply_migrations(url, connect_timeout=settings.db_timeout_s)
        await registry.connect()
        seeded = await registry.seed(settings.mcp_servers)
        log.info("registry-ready", migrations=applied, **seeded)

    @get(include_in_schema=False)
    async def servers(scope: Any) -> AsgiResponse:
        body = json.dumps({"servers": await catalog.status()}).encode()
        return AsgiResponse(body, 200, headers={"content-type": "application/json"})

    app = make_app(settings, broker,
                   readiness=[("postgres", registry.ping), ("mcp", catalog.ready)],
                   on_startup=[open_registry, catalog.load_embedder],
                   after_startup=[catalog.start],
                   # sessions and the pool close only after the broker drained in-flight calls
                   after_shutdown=[catalog.close, registry.close],
                   extra_routes=[("/mcp/servers", servers)])
    return app


create_app, main = entry_points(build, Settings)


if __name__ == "__main__":
    main()
