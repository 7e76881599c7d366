"""Start-up and operator commands.

``python -m ctxbuild_persistence``                       run the service (CTX_NATS_URL, CTX_DATABASE_URL, …)
``python -m ctxbuild_persistence migrate``               apply pending yoyo migrations and exit
``python -m ctxbuild_persistence rebuild-projections``   rebuild the conversation projection from the events
    ``--verify``  dry run: rebuild inside a transaction, compare with the live rows, roll back; exit 1 on a
                  difference
The commands read CTX_DATABASE_URL (or ``--database-url``) and print a JSON report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

import structlog
from ctxbuild_blobclient import BlobClient
from ctxbuild_platform.rpc import RpcClient
from ctxbuild_platform.service import entry_points, make_app, make_broker
from faststream.asgi import AsgiFastStream, AsgiResponse, get

from .adapters.blobs import LaneBlobs
from .adapters.db import Database, migrate, wait_for_postgres
from .adapters.enqueue import Enqueuer
from .adapters.event_store import EventStore
from .adapters.notices import TurnNotices
from .adapters.outbox import OutboxRelay
from .adapters.projection import Projector, rebuild
from .app import EventLog, History, PersistLane, to_new_events
from .handlers import register
from .settings import Settings


async def _alive(worker: Any) -> bool:
    return worker.running


def build(settings: Settings) -> AsgiFastStream:
    broker = make_broker(settings)
    url = settings.database_url.get_secret_value()
    # no session state is ever left on a connection (SET LOCAL, transaction-level advisory locks only): a released
    # connection needs no reset statement
    db = Database(url, min_size=settings.db_pool_min_size, max_size=settings.db_pool_max_size, reset_sessions=False)
    relay = OutboxRelay(
        db, lambda: broker.connection, stream=settings.events_stream,
        subject_prefix=settings.events_subject_prefix, duplicate_window_s=settings.events_duplicate_window_s,
        poll_interval_s=settings.relay_poll_interval_s, batch_size=settings.relay_batch_size,
        publish_timeout_s=settings.relay_publish_timeout_s, max_backoff_s=settings.relay_max_backoff_s,
        replicas=settings.events_stream_replicas, max_age_s=settings.events_max_age_s,
        min_interval_s=settings.relay_min_interval_s)
    projector = Projector(db, batch_size=settings.projector_batch_size, batch_bytes=settings.projector_batch_bytes,
                          poll_interval_s=settings.projector_poll_interval_s,
                          min_interval_s=settings.projector_min_interval_s)

    def on_appended() -> None:
        relay.wake()
        projector.wake()

    store = EventStore(db, writers=settings.append_writers)
    blob_client = BlobClient(RpcClient(broker, default_timeout=settings.request_timeout_s),
                             timeout_s=settings.lane_blob_timeout_s)
    blobs = LaneBlobs(blob_client, concurrency=settings.lane_blob_concurrency)
    lane = PersistLane(store, blobs, lambda evs, stream: to_new_events(evs, settings.max_event_bytes, stream),
                       on_appended, promote_inflight_refs=settings.lane_promote_inflight_refs,
                       notices=TurnNotices(lambda: broker.connection))
    enqueuer = Enqueuer(lambda: broker.connection, settings.enqueue_subject_prefix, settings.enqueue_timeout_s)
    register(broker, settings, EventLog(store, settings, on_appended, enqueuer),
             History(store, settings, projector, blob_client), lane)
    log = structlog.get_logger("persistence")

    async def open_database() -> None:
        await wait_for_postgres(url, settings.db_connect_timeout_s)
        if settings.migrate_on_start:
            applied = await asyncio.to_thread(migrate, url)
            log.info("migrations", applied=applied)
        await db.connect()

    @get(include_in_schema=False)
    async def projection_status(scope: Any) -> AsgiResponse:
        """The projection's position, last error and parked events (an alert source next to the log line)."""
        try:
            body, status = await projector.status(), 200
        except Exception as exc:  # noqa: BLE001 - a status page answers even when Postgres does not
            body, status = {"error": f"{type(exc).__name__}: {exc}"[:300]}, 503
        return AsgiResponse(json.dumps(body).encode(), status, headers={"content-type": "application/json"})

    app = make_app(settings, broker,
                   # the background loops too: one that died (it never should) is not a ready service
                   readiness=[("postgres", db.ping), ("outbox-relay", lambda: _alive(relay)),
                              ("projector", lambda: _alive(projector))],
                   extra_routes=[("/projection", projection_status)],
                   on_startup=[open_database],
                   after_startup=[relay.start, projector.start],
                   on_shutdown=[relay.stop, projector.stop])
    async def close_store() -> None:
        await store.close()  # an append still waiting (the drain timed out) is answered before the pool goes
        await db.close()

    # the pool closes only after FastStream has drained in-flight handlers (broker.stop runs after on_shutdown)
    app.after_shutdown(close_store)
    return app


create_app, serve_from_environment = entry_points(build, Settings)


async def _rebuild(url: str, verify: bool, batch_size: int) -> dict:
    await wait_for_postgres(url, 30)
    applied = await asyncio.to_thread(migrate, url)
    db = Database(url, min_size=1, max_size=2)
    await db.connect()
    try:
        report = await rebuild(db, verify=verify, batch_size=batch_size)
    finally:
        await db.close()
    report["migrationsApplied"] = applied
    return report


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m ctxbuild_persistence",
                                     description="ctxbuild persistence service (no command: run the service)")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("serve", help="run the service (the default)")
    for name, text in (("migrate", "apply pending migrations and exit"),
                       ("rebuild-projections", "rebuild the conversation projection from the event log")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--database-url", default=os.environ.get("CTX_DATABASE_URL"),
                       help="PostgreSQL URL (default: $CTX_DATABASE_URL)")
        if name == "rebuild-projections":
            p.add_argument("--verify", action="store_true",
                           help="dry run: compare a rebuild with the live rows, roll back; exit 1 if they differ")
            p.add_argument("--batch-size", type=int, default=1000)
    args = parser.parse_args(argv)
    if args.command in (None, "serve"):
        serve_from_environment()
        return 0
    if not args.database_url:
        parser.error("no database URL: set CTX_DATABASE_URL or pass --database-url")
    if args.command == "migrate":
        print(json.dumps({"applied": migrate(args.database_url)}))
        return 0
    report = asyncio.run(_rebuild(args.database_url, args.verify, args.batch_size))
    print(json.dumps(report))
    return 0 if report["identical"] or not args.verify else 1


def main() -> None:
    sys.exit(cli(sys.argv[1:]))


if __name__ == "__main__":
    main()
