"""One classification of Postgres errors for every service that talks to it (persistence, blob store, catalog), and
the asyncpg pool holder a service opens at start-up.

*Unavailable* means "not reachable or not able to answer right now": the connection, a timeout, a shutdown, too many
connections, and the transient conflicts a retry resolves (serialization failure, deadlock, a cancelled statement).
The caller gets a retryable ``unavailable``. A value the database cannot take (out of a column's range, a malformed
literal) is the caller's input: ``invalid-payload``. Anything else is a bug in our statement and propagates.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

from .errors import DependencyUnavailable, InvalidPayload
from .migrations import plain_url

UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError, asyncio.TimeoutError, TimeoutError,
    asyncpg.PostgresConnectionError, asyncpg.InterfaceError, asyncpg.CannotConnectNowError,
    asyncpg.TooManyConnectionsError, asyncpg.AdminShutdownError, asyncpg.QueryCanceledError,
    asyncpg.SerializationError, asyncpg.DeadlockDetectedError,
)
BAD_VALUE: tuple[type[BaseException], ...] = (asyncpg.DataError, OverflowError)


def is_unavailable(exc: BaseException) -> bool:
    return isinstance(exc, UNAVAILABLE)


@asynccontextmanager
async def postgres_errors(what: str = "postgres") -> AsyncIterator[None]:
    """Translate a Postgres failure into the typed error the caller can act on (see the module doc)."""
    try:
        yield
    except UNAVAILABLE as exc:
        raise DependencyUnavailable(f"{what}: {type(exc).__name__}: {exc}"[:300]) from exc
    except BAD_VALUE as exc:
        raise InvalidPayload(f"a value is out of range for the database: {exc}"[:300]) from exc


async def _keep_session(conn: asyncpg.Connection) -> None:
    """A pool's reset that sends nothing (see ``PostgresPool(reset_sessions=False)``)."""


class PostgresPool:
    """An asyncpg pool: connected at start-up, closed after the broker has drained the in-flight handlers that use
    it. ``timeout`` (when given) bounds a connection attempt and every statement.

    ``reset_sessions=False``: a released connection goes back without asyncpg's reset statement (advisory unlock,
    CLOSE ALL, UNLISTEN, RESET ALL — one more round trip per use, awaited by whoever releases it). Only for a pool
    whose users leave no session state behind (``SET LOCAL``, transaction-level advisory locks); an open
    transaction is still rolled back by asyncpg."""

    def __init__(self, url: str, *, min_size: int = 1, max_size: int = 10, timeout: float | None = None,
                 reset_sessions: bool = True) -> None:
        self.url = plain_url(url)  # ``postgresql[+driver]://…`` → the form asyncpg takes
        self.min_size, self.max_size, self.timeout = min_size, max_size, timeout
        self.reset_sessions = reset_sessions
        self._pool: asyncpg.Pool | None = None

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise DependencyUnavailable("postgres: not connected")
        return self._pool

    async def connect(self) -> None:
        if self._pool is None:
            bounds: dict[str, Any] = ({} if self.timeout is None
                                      else {"timeout": self.timeout, "command_timeout": self.timeout})
            if not self.reset_sessions:
                bounds["reset"] = _keep_session
            self._pool = await asyncpg.create_pool(self.url, min_size=self.min_size, max_size=self.max_size,
                                                   **bounds)

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
        try:
            async with self._pool.acquire(timeout=2) as conn:
                return await conn.fetchval("SELECT 1") == 1
        except Exception:  # noqa: BLE001 - any failure is "not ready"
            return False
