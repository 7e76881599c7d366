"""Schema migrations for every service that owns a Postgres schema: yoyo SQL files, applied at start-up.

Each service keeps its tables *and* yoyo's bookkeeping in its own schema, so migration ids never clash between
services sharing a database. Replicas starting together serialise on a session-level advisory lock (released
by the server if the process dies, unlike yoyo's lock-table row).
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .errors import DependencyUnavailable


def plain_url(database_url: str) -> str:
    """``postgresql[+driver]://…`` → the plain form asyncpg and psycopg understand."""
    parts = urlsplit(database_url)
    if parts.scheme.split("+", 1)[0] not in ("postgresql", "postgres"):
        raise ValueError(f"not a PostgreSQL URL: scheme {parts.scheme!r}")
    return urlunsplit(("postgresql", *parts[1:]))


def yoyo_url(database_url: str, schema: str) -> str:
    """yoyo's form: ``postgresql+psycopg://…?schema=<schema>`` (its psycopg 3 backend, tables in our schema)."""
    parts = urlsplit(plain_url(database_url))
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != "schema"] + [("schema", schema)]
    return urlunsplit(("postgresql+psycopg", parts.netloc, parts.path, urlencode(query), parts.fragment))


def _lock_key(schema: str) -> int:
    return int.from_bytes(hashlib.sha256(f"ctxbuild-migrate:{schema}".encode()).digest()[:8], "big", signed=True)


def apply_migrations_sync(database_url: str, schema: str, migrations_dir: Path,
                          connect_timeout: float = 10.0) -> list[str]:
    """Create the schema and apply pending migrations (blocking). Returns the ids applied (empty: up to date)."""
    import psycopg
    from yoyo import get_backend, read_migrations

    with psycopg.connect(plain_url(database_url), autocommit=True,
                         connect_timeout=max(1, int(connect_timeout))) as guard:
        guard.execute("SELECT pg_advisory_lock(%s)", (_lock_key(schema),))
        try:
            guard.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
            backend = get_backend(yoyo_url(database_url, schema))
            try:
                with backend.lock():
                    todo = backend.to_apply(read_migrations(str(migrations_dir)))
                    backend.apply_migrations(todo)
                return [m.id for m in todo]
            finally:
                backend.connection.close()
        finally:
            guard.execute("SELECT pg_advisory_unlock(%s)", (_lock_key(schema),))


async def apply_migrations(database_url: str, schema: str, migrations_dir: Path,
                           connect_timeout: float = 10.0) -> list[str]:
    import psycopg

    try:
        return await asyncio.to_thread(apply_migrations_sync, database_url, schema, migrations_dir, connect_timeout)
    except psycopg.OperationalError as exc:
        raise DependencyUnavailable(f"postgres: cannot migrate {schema}: {exc}") from exc
