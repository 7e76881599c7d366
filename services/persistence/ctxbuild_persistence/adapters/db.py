"""Postgres plumbing: URL forms, start-up migrations (yoyo, psycopg 3) and the asyncpg pool (the platform's)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import asyncpg
import structlog
from ctxbuild_platform import migrations
from ctxbuild_platform.postgres import PostgresPool

SCHEMA = "persistence"
MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"

log = structlog.get_logger("db")


def asyncpg_dsn(url: str) -> str:
    """``postgresql[+driver]://…`` → the plain form asyncpg understands."""
    return migrations.plain_url(url)


def psycopg_dsn(url: str) -> str:
    return migrations.plain_url(url)


def yoyo_url(url: str, schema: str = SCHEMA) -> str:
    return migrations.yoyo_url(url, schema)


def migrate(url: str, *, migrations_dir: Path = MIGRATIONS_DIR) -> list[str]:
    """Create the schema and apply pending migrations (blocking; run in a thread). Returns the applied ids."""
    return migrations.apply_migrations_sync(url, SCHEMA, migrations_dir)


async def wait_for_postgres(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    delay = 0.1
    while True:
        try:
            conn = await asyncpg.connect(asyncpg_dsn(url), timeout=5)
            await conn.close()
            return
        except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
            if time.monotonic() > deadline:
                raise
            log.warning("postgres-not-ready", error=str(exc)[:200], retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


# A FROM item that makes the current transaction's commit not wait for its WAL flush (synchronous_commit off,
# for this transaction only), set inside a worker's first statement instead of one more round trip. For the
# relay's and the projector's transactions only — what they write is redone from the events after a crash —, so a
# round of theirs costs no fsync and the appends' commits (synchronous) do not queue behind one.
RELAXED = "(SELECT set_config('synchronous_commit', 'off', true)) AS relaxed"

Database = PostgresPool  # the event store's pool: connected at start-up, closed after the broker has drained
