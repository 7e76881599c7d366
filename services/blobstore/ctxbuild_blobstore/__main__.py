"""`python -m ctxbuild_blobstore`: migrate, connect, subscribe, serve health on CTX_HTTP_PORT, collect garbage."""

from __future__ import annotations

import asyncio
import contextlib

from ctxbuild_platform.service import entry_points, make_app, make_broker
from faststream.asgi import AsgiFastStream

from .adapters.migrate import apply_migrations
from .adapters.postgres import Postgres
from .adapters.s3 import ObjectStore
from .adapters.transfer import Transfer
from .app import BlobStore, Collector, Config, gc_loop
from .domain.cache import ByteCache
from .handlers import register
from .settings import Settings


def config_from(settings: Settings) -> Config:
    return Config(read_cap=settings.read_cap_chars, max_read_bytes=settings.fs_read_max_bytes,
                  chunk_bytes=settings.transfer_chunk_bytes, part_bytes=settings.upload_part_bytes,
                  upload_max_bytes=settings.upload_max_bytes, max_uploads=settings.max_uploads,
                  index_stride=settings.index_stride_bytes, cache_object_max=settings.cache_object_max_bytes,
                  fault_exit_after_object_write=settings.fault_exit_after_object_write,
                  pattern_timeout_s=settings.fs_read_pattern_timeout_s)


def build(settings: Settings) -> AsgiFastStream:
    broker = make_broker(settings)
    db = Postgres(str(settings.database_url), min_size=settings.db_pool_min, max_size=settings.db_pool_max,
                  timeout=settings.db_timeout_s)
    s3 = ObjectStore(str(settings.s3_endpoint), settings.s3_access_key, settings.s3_secret_key.get_secret_value(),
                     settings.s3_bucket, region=settings.s3_region, timeout=settings.s3_timeout_s,
                     slow_timeout=settings.s3_slow_timeout_s)
    transfer = Transfer(broker, chunk_bytes=settings.transfer_chunk_bytes, window=settings.transfer_window,
                        timeout_s=settings.transfer_timeout_s)
    cache = ByteCache(settings.cache_bytes) if settings.cache_bytes else None
    store = BlobStore(db, s3, transfer, config=config_from(settings), cache=cache)
    collector = Collector(db, s3, grace_s=settings.gc_grace_s, upload_stale_s=settings.upload_stale_s,
                          batch=settings.gc_batch, on_delete=cache.discard if cache else None)
    register(broker, store, collector, max_workers=settings.max_workers)
    tasks: list[asyncio.Task] = []

    async def migrate() -> None:
        await apply_migrations(str(settings.database_url), connect_timeout=settings.db_timeout_s)

    async def start_gc() -> None:
        if settings.gc_interval_s > 0:
            tasks.append(asyncio.create_task(gc_loop(collector, settings.gc_interval_s), name="blobstore-gc"))

    async def stop_gc() -> None:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        tasks.clear()

    # on_startup runs before the broker subscribes, so no request ever meets an unmigrated schema
    app = make_app(settings, broker,
                   readiness=[("postgres", db.ping), ("s3", s3.ping)],
                   on_startup=[migrate, db.connect, s3.ensure_bucket],
                   after_startup=[start_gc],
                   on_shutdown=[stop_gc])
    # close the pool only AFTER the broker has drained in-flight handlers (on_shutdown runs before the drain)
    app.after_shutdown(db.close)
    return app


create_app, main = entry_points(build, Settings)


if __name__ == "__main__":
    main()
