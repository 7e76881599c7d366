"""Start-up: ``python -m ctxbuild_persistence`` (CTX_NATS_URL, CTX_DATABASE_URL, CTX_HTTP_PORT, …)."""

from __future__ import annotations

import asyncio

import structlog
from ctxbuild_platform.service import make_app, make_broker, serve
from faststream.asgi import AsgiFastStream

from .adapters.db import Database, migrate, wait_for_postgres
from .adapters.event_store import EventStore
from .adapters.outbox import OutboxRelay
from .handlers import register
from .settings import Settings


def build(settings: Settings) -> AsgiFastStream:
    broker = make_broker(settings)
    url = settings.database_url.get_secret_value()
    db = Database(url, min_size=settings.db_pool_min_size, max_size=settings.db_pool_max_size)
    relay = OutboxRelay(
        db, lambda: broker.connection, stream=settings.events_stream,
        subject_prefix=settings.events_subject_prefix, duplicate_window_s=settings.events_duplicate_window_s,
        poll_interval_s=settings.relay_poll_interval_s, batch_size=settings.relay_batch_size,
        publish_timeout_s=settings.relay_publish_timeout_s, max_backoff_s=settings.relay_max_backoff_s)
    register(broker, settings, EventStore(db), relay.wake)
    log = structlog.get_logger("persistence")

    async def open_database() -> None:
        await wait_for_postgres(url, settings.db_connect_timeout_s)
        if settings.migrate_on_start:
            applied = await asyncio.to_thread(migrate, url)
            log.info("migrations", applied=applied)
        await db.open()

    app = make_app(settings, broker,
                   readiness=[("postgres", db.ping)],
                   on_startup=[open_database],
                   after_startup=[relay.start],
                   on_shutdown=[relay.stop])
    # the pool closes only after FastStream has drained in-flight handlers (broker.stop runs after on_shutdown)
    app.after_shutdown(db.close)
    return app


def create_app() -> AsgiFastStream:
    """The app from the environment, unconnected (also used by `ctxbuild_platform.gen_docs`)."""
    return build(Settings())


def main() -> None:
    settings = Settings()
    serve(build(settings), settings)


if __name__ == "__main__":
    main()
