"""Postgres plumbing: URL forms, start-up migrations (yoyo, psycopg 3) and the asyncpg pool."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg
import psycopg
import structlog

SCHEMA = "persistence"
MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
MIGRATION_LOCK = 0x6374785F6D696772  # 'ctx_migr': serializes schema creation + migrations across replicas

log = structlog.get_logger("db")


def _split(url: str):
    parts = urlsplit(url)
    scheme = parts.scheme.split("+", 1)[0]
    if scheme not in ("postgresql", "postgres"):
        raise ValueError(f"not a PostgreSQL URL: scheme {parts.scheme!r}")
    return parts


def asyncpg_dsn(url: str) -> str:
    """``postgresql[+driver]://…`` → the plain form asyncpg understands."""
    parts = _split(url)
    return urlunsplit(("postgresql", *parts[1:]))


def psycopg_dsn(url: str) -> str:
    return asyncpg_dsn(url)


def yoyo_url(url: str, schema: str = SCHEMA) -> str:
    """yoyo's form: ``postgresql+psycopg://…?schema=<schema>`` (its bookkeeping tables live in our schema)."""
    parts = _split(url)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != "schema"] + [("schema", schema)]
    return urlunsplit(("postgresql+psycopg", parts.netloc, parts.path, urlencode(query), parts.fragment))


def migrate(url: str, *, migrations_dir: Path = MIGRATIONS_DIR) -> list[str]:
    """Create the schema and apply pending migrations (blocking; run in a thread). Returns the applied ids."""
    from yoyo import get_backend, read_migrations

    with psycopg.connect(psycopg_dsn(url), autocommit=True) as guard:
        # session-level lock: replicas starting together migrate one after the other
        guard.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK,))
        try:
            guard.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
            backend = get_backend(yoyo_url(url))
            try:
                migrations = read_migrations(str(migrations_dir))
                with backend.lock():
                    pending = backend.to_apply(migrations)
                    backend.apply_migrations(pending)
                return [m.id for m in pending]
            finally:
                backend.connection.close()
        finally:
            guard.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK,))


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


class Database:
    """Owns the asyncpg pool; created at start-up, closed after the broker has drained."""

    def __init__(self, url: str, *, min_size: int = 1, max_size: int = 10) -> None:
        self.url = url
        self.min_size = min_size
        self.max_size = max_size
        self._pool: asyncpg.Pool | None = None

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise RuntimeError("database pool not open")
        return self._pool

    async def open(self) -> None:
        if self._pool is None:
            self._pool = await asyncpg.create_pool(asyncpg_dsn(self.url), min_size=self.min_size,
                                                   max_size=self.max_size)

    async def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            try:
                await asyncio.wait_for(pool.close(), timeout=10)
            except TimeoutError:
                pool.terminate()

    async def ping(self) -> bool:
        if self._pool is None:
            return False
        return await self._pool.fetchval("SELECT 1") == 1
