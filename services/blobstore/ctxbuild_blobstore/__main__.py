"""`python -m ctxbuild_blobstore`: migrate, connect, subscribe, serve health on CTX_HTTP_PORT."""

from __future__ import annotations

from ctxbuild_platform.service import make_app, make_broker, serve
from faststream.asgi import AsgiFastStream

from .adapters.migrate import apply_migrations
from .adapters.postgres import Postgres
from .adapters.s3 import ObjectStore
from .handlers import register
from .settings import Settings
from .usecases import BlobStore, TextCache


def build(settings: Settings) -> AsgiFastStream:
    broker = make_broker(settings)
    db = Postgres(str(settings.database_url), min_size=settings.db_pool_min, max_size=settings.db_pool_max,
                  timeout=settings.db_timeout_s)
    s3 = ObjectStore(str(settings.s3_endpoint), settings.s3_access_key, settings.s3_secret_key.get_secret_value(),
                     settings.s3_bucket, region=settings.s3_region, timeout=settings.s3_timeout_s)
    store = BlobStore(db, s3, read_cap=settings.read_cap_chars, max_read_bytes=settings.fs_read_max_bytes,
                      cache=TextCache(settings.cache_bytes) if settings.cache_bytes else None)
    register(broker, store, max_workers=settings.max_workers)

    async def migrate() -> None:
        await apply_migrations(str(settings.database_url), connect_timeout=settings.db_timeout_s)

    # on_startup runs before the broker subscribes, so no request ever meets an unmigrated schema
    app = make_app(settings, broker,
                   readiness=[("postgres", db.ping), ("s3", s3.ping)],
                   on_startup=[migrate, db.connect, s3.ensure_bucket])
    # close the pool only AFTER the broker has drained in-flight handlers (on_shutdown runs before the drain)
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
