"""Metadata and references in PostgreSQL (schema `blobstore`), via an asyncpg pool.

Connection trouble and timeouts become DependencyUnavailable (retryable); a constraint we did not expect
becomes a typed `storage-error`. Every statement names its schema, so search_path does not matter.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import asyncpg
import structlog
from ctxbuild_platform.errors import DependencyUnavailable, ServiceError

from ..domain.fsread import Candidate
from ..domain.handles import unique_handle

log = structlog.get_logger("blobstore.postgres")

# errors that mean "the database is not reachable right now", as opposed to "this statement is wrong"
_UNAVAILABLE = (OSError, asyncio.TimeoutError, TimeoutError, asyncpg.PostgresConnectionError,
                asyncpg.InterfaceError, asyncpg.CannotConnectNowError, asyncpg.TooManyConnectionsError,
                asyncpg.SerializationError, asyncpg.DeadlockDetectedError, asyncpg.QueryCanceledError,
                asyncpg.AdminShutdownError)


class OwnerConflict(ServiceError):
    """The owner already references this blob under another conversation (owners are global ids)."""

    code = "owner-conflict"


@dataclass(frozen=True, slots=True)
class Attachment:
    handle: str
    display_name: str
    sha256: str
    media_type: str
    size: int


class Postgres:
    def __init__(self, dsn: str, *, min_size: int = 1, max_size: int = 10, timeout: float = 5.0) -> None:
        self.dsn = dsn
        self.min_size, self.max_size, self.timeout = min_size, max_size, timeout
        self._pool: asyncpg.Pool | None = None

    async def connect(self) -> None:
        try:
            self._pool = await asyncpg.create_pool(
                self.dsn, min_size=self.min_size, max_size=self.max_size, timeout=self.timeout,
                command_timeout=self.timeout)
        except _UNAVAILABLE as exc:
            raise DependencyUnavailable(f"postgres: cannot connect: {exc}") from exc

    async def close(self) -> None:
        if self._pool is not None:
            try:
                await asyncio.wait_for(self._pool.close(), timeout=self.timeout)
            except TimeoutError:
                self._pool.terminate()
            self._pool = None

    async def ping(self) -> bool:
        async with self._conn() as conn:
            return await conn.fetchval("SELECT 1") == 1

    @asynccontextmanager
    async def _conn(self) -> AsyncIterator[asyncpg.Connection]:
        if self._pool is None:
            raise DependencyUnavailable("postgres: not connected")
        try:
            async with self._pool.acquire(timeout=self.timeout) as conn:
                yield conn
        except ServiceError:
            raise
        except _UNAVAILABLE as exc:
            raise DependencyUnavailable(f"postgres: {type(exc).__name__}: {exc}") from exc
        except asyncpg.PostgresError as exc:
            log.exception("postgres-error")
            raise ServiceError(f"postgres: {type(exc).__name__}: {exc}", code="storage-error") from exc

    # ---------- writes ----------
    @staticmethod
    async def _upsert_blob(conn: asyncpg.Connection, sha256: str, size: int, chars: int, media_type: str) -> bool:
        """True when this call created the metadata row (the content was new)."""
        created = await conn.fetchval(
            "INSERT INTO blobstore.blobs (sha256, size, chars, media_type) VALUES ($1, $2, $3, $4) "
            "ON CONFLICT (sha256) DO NOTHING RETURNING true", sha256, size, chars, media_type)
        if created:
            # practically impossible by chance, but crafted content can do it: fs_read will refuse the handle
            same = await conn.fetchval("SELECT count(*) FROM blobstore.blobs WHERE prefix = left($1, 16)", sha256)
            if same > 1:
                log.warning("handle-prefix-collision", sha256=sha256, blobs=same)
        return bool(created)

    @staticmethod
    async def _add_ref(conn: asyncpg.Connection, sha256: str, owner_kind: str, owner_id: str, role: str,
                       conversation_id: str) -> None:
        inserted = await conn.fetchval(
            "INSERT INTO blobstore.refs (sha256, owner_kind, owner_id, role, conversation_id) "
            "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (sha256, owner_kind, owner_id, role) DO NOTHING "
            "RETURNING true", sha256, owner_kind, owner_id, role, conversation_id)
        if inserted:
            return
        existing = await conn.fetchval(
            "SELECT conversation_id FROM blobstore.refs WHERE sha256 = $1 AND owner_kind = $2 "
            "AND owner_id = $3 AND role = $4", sha256, owner_kind, owner_id, role)
        if existing is not None and existing != conversation_id:
            # silently keeping the old row would leave the new conversation without read access
            raise OwnerConflict(f"{owner_kind} {owner_id!r} already references this blob for another "
                                "conversation")

    async def record_put(self, *, sha256: str, size: int, chars: int, media_type: str, owner_kind: str,
                         owner_id: str, role: str, conversation_id: str) -> bool:
        """Metadata + reference in one transaction; returns whether the blob is new."""
        async with self._conn() as conn, conn.transaction():
            created = await self._upsert_blob(conn, sha256, size, chars, media_type)
            await self._add_ref(conn, sha256, owner_kind, owner_id, role, conversation_id)
            return created

    async def record_attachment(self, *, conversation_id: str, display_name: str, sha256: str, size: int,
                                chars: int, media_type: str) -> Attachment:
        """Blob + `attachment` reference owned by the conversation + an attachments row with a unique handle."""
        async with self._conn() as conn, conn.transaction():
            # serialise handle allocation per conversation (two uploads of "a.txt" must get "a.txt", "a.txt (2)")
            await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended('blobstore.attach:' || $1, 0))",
                               conversation_id)
            await self._upsert_blob(conn, sha256, size, chars, media_type)
            await self._add_ref(conn, sha256, "conversation", conversation_id, "attachment", conversation_id)
            taken = await conn.fetch(
                "SELECT handle FROM blobstore.attachments WHERE conversation_id = $1 "
                "AND left(handle, length($2)) = $2", conversation_id, display_name)
            handle = unique_handle(display_name, {r["handle"] for r in taken})
            await conn.execute(
                "INSERT INTO blobstore.attachments (conversation_id, handle, display_name, sha256, media_type, size)"
                " VALUES ($1, $2, $3, $4, $5, $6)", conversation_id, handle, display_name, sha256, media_type, size)
            return Attachment(handle, display_name, sha256, media_type, size)

    # ---------- reads ----------
    async def candidates(self, prefix: str, conversation_id: str) -> Sequence[Candidate]:
        """Every blob named by the 16-hex prefix, each with whether this conversation references it."""
        async with self._conn() as conn:
            rows = await conn.fetch(
                "SELECT b.sha256, b.size, EXISTS (SELECT 1 FROM blobstore.refs r WHERE r.sha256 = b.sha256 "
                "AND r.conversation_id = $2) AS allowed FROM blobstore.blobs b WHERE b.prefix = $1 "
                "ORDER BY b.sha256", prefix, conversation_id)
        return [Candidate(r["sha256"], r["size"], r["allowed"]) for r in rows]

    async def attachment(self, conversation_id: str, handle: str) -> Attachment | None:
        async with self._conn() as conn:
            r = await conn.fetchrow(
                "SELECT handle, display_name, sha256, media_type, size FROM blobstore.attachments "
                "WHERE conversation_id = $1 AND handle = $2", conversation_id, handle)
        return Attachment(r["handle"], r["display_name"], r["sha256"], r["media_type"], r["size"]) if r else None

    async def attachment_handles(self, conversation_id: str, limit: int = 20) -> list[str]:
        async with self._conn() as conn:
            rows = await conn.fetch(
                "SELECT handle FROM blobstore.attachments WHERE conversation_id = $1 ORDER BY created_at, handle "
                "LIMIT $2", conversation_id, limit)
        return [r["handle"] for r in rows]
