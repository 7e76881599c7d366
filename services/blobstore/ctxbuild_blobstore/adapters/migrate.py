"""Schema migrations (yoyo, SQL files in ../migrations), applied at start-up before any handler subscribes.

yoyo's bookkeeping tables go into the `blobstore` schema too, so migration ids never clash with another
service's in the same database. Replicas starting together serialise on a Postgres advisory lock (released by
the server if we crash, unlike yoyo's lock-table row).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg
from ctxbuild_platform.errors import DependencyUnavailable
from yoyo import get_backend, read_migrations

SCHEMA = "blobstore"
MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
_LOCK_KEY = 0x626C6F6273746F72  # "blobstor"


def yoyo_url(database_url: str, schema: str = SCHEMA) -> str:
    """postgresql://… → postgresql+psycopg://…?schema=… (yoyo picks its psycopg 3 backend from the scheme)."""
    parts = urlsplit(database_url)
    query = dict(parse_qsl(parts.query))
    query["schema"] = schema
    return urlunsplit(("postgresql+psycopg", parts.netloc, parts.path, urlencode(query), parts.fragment))


def apply_migrations_sync(database_url: str, connect_timeout: float = 10.0) -> list[str]:
    """Apply pending migrations; returns the ids applied (empty when up to date)."""
    with psycopg.connect(database_url, autocommit=True, connect_timeout=max(1, int(connect_timeout))) as conn:
        conn.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
        conn.execute("SELECT pg_advisory_lock(%s)", (_LOCK_KEY,))
        try:
            backend = get_backend(yoyo_url(database_url))
            try:
                todo = backend.to_apply(read_migrations(str(MIGRATIONS_DIR)))
                backend.apply_migrations(todo)
                return [m.id for m in todo]
            finally:
                backend.connection.close()
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_LOCK_KEY,))


async def apply_migrations(database_url: str, connect_timeout: float = 10.0) -> list[str]:
    try:
        return await asyncio.to_thread(apply_migrations_sync, database_url, connect_timeout)
    except psycopg.OperationalError as exc:
        raise DependencyUnavailable(f"postgres: cannot migrate: {exc}") from exc
