"""One classification of Postgres errors for every service that talks to it (persistence, blob store, catalog).

*Unavailable* means "not reachable or not able to answer right now": the connection, a timeout, a shutdown, too many
connections, and the transient conflicts a retry resolves (serialization failure, deadlock, a cancelled statement).
The caller gets a retryable ``unavailable``. A value the database cannot take (out of a column's range, a malformed
literal) is the caller's input: ``invalid-payload``. Anything else is a bug in our statement and propagates.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg

from .errors import DependencyUnavailable, InvalidPayload

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
