"""Metadata and references in PostgreSQL (schema `blobstore`), via an asyncpg pool.

Connection trouble and timeouts become DependencyUnavailable (retryable), a value the database cannot take
invalid-payload (both classified by :mod:`ctxbuild_platform.postgres`); a constraint we did not expect becomes a
typed `storage-error`. Every statement names its schema, so search_path does not matter.

Writers and the garbage collector meet on one Postgres advisory lock per blob (key: the first 64 bits of its
sha256). A writer holds it *shared* (transaction-scoped) from "does the blob exist?" until its metadata + reference
commit — across the S3 write in between — so a collector, which needs it *exclusive* and never waits for it, can
never delete an object or a row that a concurrent put is about to (re)reference.
"""

from __future__ import annotations

import asyncio
import re
from array import array
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import asyncpg
import structlog
from ctxbuild_platform.errors import DependencyUnavailable, ServiceError
from ctxbuild_platform.postgres import UNAVAILABLE, postgres_errors

from ..domain.fsread import Candidate
from ..domain.handles import unique_handle
from ..domain.keys import lock_key
from ..domain.textindex import Marks, TextIndex, origin_marks

log = structlog.get_logger("blobstore.postgres")

_HEX64 = re.compile(r"[0-9a-f]{64}")
GC_LEADER_KEY = 0x626C6F6267636C72  # "blobgclr": one collector at a time across replicas


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


@dataclass(frozen=True, slots=True)
class BlobInfo:
    sha256: str
    size: int
    chars: int | None
    lines: int | None
    is_text: bool | None  # None: a row from before the index existed (indexed lazily on first read)
    media_type: str


@dataclass(frozen=True, slots=True)
class RefSpec:
    owner_kind: str
    owner_id: str
    role: str
    conversation_id: str
    members: tuple[str, ...] = ()  # a fold transcript's members (16-hex handles), recorded with the reference


@dataclass(frozen=True, slots=True)
class NewBlob:
    """What the writer learnt while streaming the bytes in."""

    size: int
    media_type: str
    index: TextIndex


_INFO_COLS = "b.sha256, b.size, b.chars, b.lines, b.is_text, b.media_type"


def _info(r: asyncpg.Record) -> BlobInfo:
    return BlobInfo(r["sha256"], r["size"], r["chars"], r["lines"], r["is_text"], r["media_type"])


class LockedBlob:
    """A connection holding the blob's shared advisory lock (see module doc). ``existed``: whether the metadata
    row was there when the lock was taken (it cannot vanish while the lock is held)."""

    def __init__(self, conn: asyncpg.Connection, sha256: str, existed: bool, prepared: Any = None) -> None:
        self.conn = conn
        self.sha256 = sha256
        self.existed = existed
        self.prepared = prepared  # what ``blob_lock(meanwhile=…)`` computed while the lock was being taken

    async def exists(self) -> bool:
        return self.existed

    async def referenced_by(self, conversation_id: str) -> bool:
        return bool(await self.conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM blobstore.refs WHERE sha256 = $1 AND conversation_id = $2)",
            self.sha256, conversation_id))

    async def record(self, new: NewBlob | None, ref: RefSpec,
                     attachment: tuple[str, str] | None = None) -> tuple[bool, Attachment | None]:
        """Metadata (when ``new``) + the reference (+ an attachment handle), atomically.

        Returns ``(created, attachment)``: created is True when this call inserted the metadata row.
        ``new=None`` references a blob that already exists (under this lock it cannot vanish).
        Part of the lock's transaction: nothing is visible to anyone else before it commits. Without an
        attachment this is ONE statement (one round trip)."""
        conn, sha = self.conn, self.sha256
        created, inserted = await _record(conn, sha, new, ref)
        if not inserted:
            await _check_owner(conn, sha, ref)
        if ref.members:
            await conn.execute(
                "INSERT INTO blobstore.blob_members (conversation_id, transcript_sha256, member_prefix) "
                "SELECT $1, $2, unnest($3::text[]) ON CONFLICT DO NOTHING",
                ref.conversation_id, sha, list(ref.members))
        if attachment is None:
            return created, None
        display_name, media_type = attachment
        size = await conn.fetchval("SELECT size FROM blobstore.blobs WHERE sha256 = $1", sha)
        att = await _allocate_attachment(conn, ref.conversation_id, display_name, sha, media_type, size)
        return created, att


_REF_CTE = ("r AS (INSERT INTO blobstore.refs (sha256, owner_kind, owner_id, role, conversation_id) "
            "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (sha256, owner_kind, owner_id, role) DO NOTHING "
            "RETURNING true AS inserted)")


async def _record(conn: asyncpg.Connection, sha256: str, new: NewBlob | None, ref: RefSpec) -> tuple[bool, bool]:
    """(created, reference inserted). Blob row, seek index and reference in one statement: a foreign key to a
    row inserted by a sibling CTE is checked at the end of the statement, so the order is consistent."""
    args: list = [sha256, ref.owner_kind, ref.owner_id, ref.role, ref.conversation_id]
    if new is None:
        row = await conn.fetchrow(
            "WITH b AS (UPDATE blobstore.blobs SET unreferenced_since = NULL WHERE sha256 = $1 "
            f"AND unreferenced_since IS NOT NULL RETURNING 1), {_REF_CTE} "
            "SELECT false AS created, coalesce((SELECT inserted FROM r), false) AS inserted, 0 AS same_prefix", *args)
        return False, bool(row["inserted"])
    ix = new.index
    args += [new.size, ix.chars, ix.lines, ix.is_text, new.media_type]
    index_cte = ""
    if not ix.trivial:
        args += [list(ix.line_marks.keys), list(ix.line_marks.offsets), list(ix.char_marks.keys),
                 list(ix.char_marks.offsets)]
        index_cte = (", i AS (INSERT INTO blobstore.blob_index (sha256, line_nos, line_offsets, char_nos, "
                     "char_offsets) SELECT $1, $11, $12, $13, $14 WHERE EXISTS (SELECT 1 FROM b WHERE created) "
                     "ON CONFLICT (sha256) DO NOTHING)")
    row = await conn.fetchrow(
        "WITH b AS (INSERT INTO blobstore.blobs (sha256, size, chars, lines, is_text, media_type) "
        "VALUES ($1, $6, $7, $8, $9, $10) ON CONFLICT (sha256) DO UPDATE SET unreferenced_since = NULL "
        "WHERE blobstore.blobs.unreferenced_since IS NOT NULL RETURNING (xmax = 0) AS created), "
        f"{_REF_CTE}{index_cte} "
        "SELECT coalesce((SELECT created FROM b), false) AS created, "
        "coalesce((SELECT inserted FROM r), false) AS inserted, "
        # rows visible to this statement exclude the one it inserts
        "(SELECT count(*) FROM blobstore.blobs WHERE prefix = left($1, 16)) AS same_prefix", *args)
    created = bool(row["created"])
    if created and row["same_prefix"] > 0:
        # practically impossible by chance, but crafted content can do it: fs_read will refuse the handle
        log.warning("handle-prefix-collision", sha256=sha256, others=row["same_prefix"])
    return created, bool(row["inserted"])


async def _check_owner(conn: asyncpg.Connection, sha256: str, ref: RefSpec) -> None:
    existing = await conn.fetchval(
        "SELECT conversation_id FROM blobstore.refs WHERE sha256 = $1 AND owner_kind = $2 "
        "AND owner_id = $3 AND role = $4", sha256, ref.owner_kind, ref.owner_id, ref.role)
    if existing is not None and existing != ref.conversation_id:
        # silently keeping the old row would leave the new conversation without read access
        raise OwnerConflict(f"{ref.owner_kind} {ref.owner_id!r} already references this blob for another "
                            "conversation")


async def _allocate_attachment(conn: asyncpg.Connection, conversation_id: str, display_name: str, sha256: str,
                               media_type: str, size: int) -> Attachment:
    # serialise handle allocation per conversation (two uploads of "a.txt" must get "a.txt", "a.txt (2)")
    await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended('blobstore.attach:' || $1, 0))",
                       conversation_id)
    taken = await conn.fetch(
        "SELECT handle FROM blobstore.attachments WHERE conversation_id = $1 "
        "AND left(handle, length($2)) = $2", conversation_id, display_name)
    handle = unique_handle(display_name, {r["handle"] for r in taken})
    await conn.execute(
        "INSERT INTO blobstore.attachments (conversation_id, handle, display_name, sha256, media_type, size)"
        " VALUES ($1, $2, $3, $4, $5, $6)", conversation_id, handle, display_name, sha256, media_type, size)
    return Attachment(handle, display_name, sha256, media_type, size)


async def _no_session_state(conn: asyncpg.Connection) -> None:
    """Pool reset: this adapter keeps no session state (no SET, LISTEN or cursors), releases every session-level
    advisory lock it takes explicitly (:func:`_unlock`) and ends every transaction it opens (:func:`_commit`,
    :func:`_rollback`), so the default reset round trip on every release is skipped."""


async def _commit(conn: asyncpg.Connection) -> None:
    """COMMIT a transaction opened by hand. If that fails the session is dropped (and the error raised): a pooled
    connection must never carry an open transaction, or the locks it holds, to its next user."""
    try:
        await conn.execute("COMMIT")
    except BaseException:
        log.warning("commit-failed-terminating-connection")
        conn.terminate()
        raise


async def _rollback(conn: asyncpg.Connection) -> None:
    """ROLLBACK (a no-op outside a transaction); if even that fails, drop the session. Never raises: it runs
    while another error is on its way out."""
    try:
        await conn.execute("ROLLBACK")
    except BaseException:  # noqa: BLE001 - incl. a cancellation arriving now: the session goes either way
        log.warning("rollback-failed-terminating-connection")
        conn.terminate()


async def _unlock(conn: asyncpg.Connection, sql: str, key: int) -> None:
    try:
        await conn.execute(sql, key)
    except Exception:  # noqa: BLE001 - a lock must never outlive its holder: drop the session instead
        log.warning("unlock-failed-terminating-connection", key=key)
        conn.terminate()


class Postgres:
    def __init__(self, dsn: str, *, min_size: int = 1, max_size: int = 10, timeout: float = 5.0) -> None:
        self.dsn = dsn
        self.min_size, self.max_size, self.timeout = min_size, max_size, timeout
        self._pool: asyncpg.Pool | None = None

    async def connect(self) -> None:
        try:
            self._pool = await asyncpg.create_pool(
                self.dsn, min_size=self.min_size, max_size=self.max_size, timeout=self.timeout,
                command_timeout=self.timeout, reset=_no_session_state)
        except UNAVAILABLE as exc:
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
            async with postgres_errors("postgres"), self._pool.acquire(timeout=self.timeout) as conn:
                yield conn
        except ServiceError:
            raise
        except asyncpg.PostgresError as exc:
            log.exception("postgres-error")
            raise ServiceError(f"postgres: {type(exc).__name__}: {exc}", code="storage-error") from exc

    # ---------- writes (under the blob's shared lock) ----------
    @asynccontextmanager
    async def blob_lock(self, sha256: str, meanwhile: Callable[[], Any] | None = None) -> AsyncIterator[LockedBlob]:
        """A transaction holding the blob's shared lock (transaction-scoped), then whether its row exists — a
        separate statement, so its snapshot is taken after the lock was granted. Writes through the yielded
        :class:`LockedBlob` belong to that transaction: it commits when the block ends normally (releasing the lock
        with it) and rolls back on an exception. So a writer may run its metadata INSERT while its S3 write is in
        flight: nothing is visible before the COMMIT, which comes after the object exists.

        ``meanwhile``: CPU work to do while Postgres answers (the loop would idle through that round trip); its
        result is the yielded blob's ``prepared``."""
        async with self._conn() as conn:
            key = lock_key(sha256)
            prepared = None
            try:
                if _HEX64.fullmatch(sha256):
                    # one round trip: three statements in one simple query. Under READ COMMITTED each statement
                    # takes its own snapshot, so the existence check still sees everything committed before the
                    # lock was granted; its command tag ("SELECT 1" / "SELECT 0") is the answer. Both values are
                    # literals we derived (an int, a validated hex digest): nothing of a caller's is spliced in.
                    sent = asyncio.ensure_future(conn.execute(
                        f"BEGIN; SELECT pg_advisory_xact_lock_shared('{int(key)}'::bigint); "
                        f"SELECT 1 FROM blobstore.blobs WHERE sha256 = '{sha256}'"))
                    if meanwhile is not None:
                        await asyncio.sleep(0)  # one step of the task: the query is on the wire
                        try:
                            prepared = meanwhile()
                        except BaseException:
                            await asyncio.gather(sent, return_exceptions=True)
                            raise
                    tag = await sent
                    existed = tag.strip() != "SELECT 0"
                else:  # never a content address; kept for completeness
                    await conn.execute("BEGIN")
                    await conn.execute("SELECT pg_advisory_xact_lock_shared($1)", key)
                    existed = await conn.fetchval(
                        "SELECT EXISTS (SELECT 1 FROM blobstore.blobs WHERE sha256 = $1)", sha256)
                    prepared = meanwhile() if meanwhile is not None else None
            except BaseException:
                await _rollback(conn)
                raise
            try:
                yield LockedBlob(conn, sha256, bool(existed), prepared)
            except BaseException:
                await _rollback(conn)
                raise
            await _commit(conn)

    async def release(self, owner_kind: str, owner_id: str, role: str | None = None,
                      sha256: str | None = None) -> list[str]:
        """Delete the owner's references (optionally one role / one blob); a blob left with none starts its
        grace period. Releasing an attachment reference removes the conversation's handles for that blob."""
        async with self._conn() as conn, conn.transaction():
            rows = await conn.fetch(
                "DELETE FROM blobstore.refs WHERE owner_kind = $1 AND owner_id = $2 "
                "AND ($3::text IS NULL OR role = $3) AND ($4::text IS NULL OR sha256 = $4) "
                "RETURNING sha256, role, conversation_id", owner_kind, owner_id, role, sha256)
            shas = sorted({r["sha256"] for r in rows})
            for r in rows:
                if r["role"] == "attachment":
                    await conn.execute("DELETE FROM blobstore.attachments WHERE conversation_id = $1 AND sha256 = $2",
                                       r["conversation_id"], r["sha256"])
            if shas:
                await conn.execute(
                    "UPDATE blobstore.blobs b SET unreferenced_since = now() WHERE b.sha256 = ANY($1::text[]) "
                    "AND NOT EXISTS (SELECT 1 FROM blobstore.refs r WHERE r.sha256 = b.sha256)", shas)
            return [r["sha256"] for r in rows]

    async def store_index(self, sha256: str, index: TextIndex) -> None:
        """Fill in the text facts of a row written before the index existed."""
        async with self._conn() as conn, conn.transaction():
            await conn.execute("UPDATE blobstore.blobs SET chars = $2, lines = $3, is_text = $4 WHERE sha256 = $1",
                               sha256, index.chars, index.lines, index.is_text)
            if not index.trivial:
                await conn.execute(
                    "INSERT INTO blobstore.blob_index (sha256, line_nos, line_offsets, char_nos, char_offsets) "
                    "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (sha256) DO NOTHING", sha256,
                    list(index.line_marks.keys), list(index.line_marks.offsets), list(index.char_marks.keys),
                    list(index.char_marks.offsets))

    # ---------- reads ----------
    async def candidates(self, prefix: str, conversation_id: str) -> list[tuple[Candidate, BlobInfo]]:
        """Every blob named by the 16-hex prefix, each with whether this conversation references it."""
        async with self._conn() as conn:
            rows = await conn.fetch(
                f"SELECT {_INFO_COLS}, EXISTS (SELECT 1 FROM blobstore.refs r WHERE r.sha256 = b.sha256 "
                "AND r.conversation_id = $2) AS allowed FROM blobstore.blobs b WHERE b.prefix = $1 "
                "ORDER BY b.sha256", prefix, conversation_id)
        return [(Candidate(r["sha256"], r["size"], r["allowed"]), _info(r)) for r in rows]

    async def turn_references(self, sha256s: Sequence[str], conversation_id: str, turn_id: str) -> set[str]:
        """Which of these blobs the turn itself references in this conversation (its offloads, claims, folds)."""
        async with self._conn() as conn:
            rows = await conn.fetch(
                "SELECT DISTINCT sha256 FROM blobstore.refs WHERE sha256 = ANY($1::text[]) AND conversation_id = $2 "
                "AND owner_kind = 'turn' AND owner_id = $3", list(sha256s), conversation_id, turn_id)
        return {r["sha256"] for r in rows}

    async def member_of(self, prefix: str, conversation_id: str, transcripts: Sequence[str]) -> bool:
        """Whether a transcript (by handle) of this conversation lists the handle ``prefix`` as a member."""
        if not transcripts:
            return False
        async with self._conn() as conn:
            return bool(await conn.fetchval(
                "SELECT EXISTS (SELECT 1 FROM blobstore.blob_members WHERE conversation_id = $1 "
                "AND member_prefix = $2 AND transcript_prefix = ANY($3::text[]))",
                conversation_id, prefix, list(transcripts)))

    async def blob(self, sha256: str, conversation_id: str) -> tuple[BlobInfo, bool] | None:
        """The blob and whether the conversation may read it; None when there is no such blob."""
        async with self._conn() as conn:
            r = await conn.fetchrow(
                f"SELECT {_INFO_COLS}, EXISTS (SELECT 1 FROM blobstore.refs r WHERE r.sha256 = b.sha256 "
                "AND r.conversation_id = $2) AS allowed FROM blobstore.blobs b WHERE b.sha256 = $1",
                sha256, conversation_id)
        return (_info(r), bool(r["allowed"])) if r else None

    async def marks(self, sha256: str) -> tuple[Marks, Marks]:
        """(line marks, char marks); origin-only when the blob is small enough to have no index row."""
        async with self._conn() as conn:
            r = await conn.fetchrow("SELECT line_nos, line_offsets, char_nos, char_offsets FROM blobstore.blob_index "
                                    "WHERE sha256 = $1", sha256)
        if r is None:
            return origin_marks(1), origin_marks(0)
        return (Marks(array("q", r["line_nos"]), array("q", r["line_offsets"])),
                Marks(array("q", r["char_nos"]), array("q", r["char_offsets"])))

    async def attachment(self, conversation_id: str, handle: str) -> tuple[Attachment, BlobInfo] | None:
        async with self._conn() as conn:
            r = await conn.fetchrow(
                f"SELECT a.handle, a.display_name, {_INFO_COLS}, a.media_type AS att_media_type "
                "FROM blobstore.attachments a JOIN blobstore.blobs b ON b.sha256 = a.sha256 "
                "WHERE a.conversation_id = $1 AND a.handle = $2", conversation_id, handle)
        if r is None:
            return None
        return Attachment(r["handle"], r["display_name"], r["sha256"], r["att_media_type"], r["size"]), _info(r)

    async def attachment_handles(self, conversation_id: str, limit: int = 20) -> list[str]:
        async with self._conn() as conn:
            rows = await conn.fetch(
                "SELECT handle FROM blobstore.attachments WHERE conversation_id = $1 ORDER BY created_at, handle "
                "LIMIT $2", conversation_id, limit)
        return [r["handle"] for r in rows]

    # ---------- garbage collection ----------
    @asynccontextmanager
    async def gc_leader(self) -> AsyncIterator[bool]:
        """True when this process may collect now (one collector at a time across replicas)."""
        async with self._conn() as conn:
            got = await conn.fetchval("SELECT pg_try_advisory_lock($1)", GC_LEADER_KEY)
            try:
                yield bool(got)
            finally:
                if got:
                    await _unlock(conn, "SELECT pg_advisory_unlock($1)", GC_LEADER_KEY)

    async def collectable(self, grace_s: float, limit: int) -> list[str]:
        async with self._conn() as conn:
            rows = await conn.fetch(
                "SELECT sha256 FROM blobstore.blobs b WHERE unreferenced_since IS NOT NULL "
                "AND unreferenced_since < now() - make_interval(secs => $1) "
                "AND NOT EXISTS (SELECT 1 FROM blobstore.refs r WHERE r.sha256 = b.sha256) "
                "ORDER BY unreferenced_since LIMIT $2", grace_s, limit)
        return [r["sha256"] for r in rows]

    async def known(self, shas: Sequence[str]) -> set[str]:
        async with self._conn() as conn:
            rows = await conn.fetch("SELECT sha256 FROM blobstore.blobs WHERE sha256 = ANY($1::text[])", list(shas))
        return {r["sha256"] for r in rows}

    @asynccontextmanager
    async def exclusive(self, sha256: str) -> AsyncIterator[asyncpg.Connection | None]:
        """The blob's lock, exclusively, without waiting: None when a writer holds it (skip this round)."""
        async with self._conn() as conn:
            key = lock_key(sha256)
            got = await conn.fetchval("SELECT pg_try_advisory_lock($1)", key)
            try:
                yield conn if got else None
            finally:
                if got:
                    await _unlock(conn, "SELECT pg_advisory_unlock($1)", key)

    @staticmethod
    async def delete_if_collectable(conn: asyncpg.Connection, sha256: str, grace_s: float) -> bool:
        """Re-check under the exclusive lock, then delete the metadata (the object goes after the commit)."""
        async with conn.transaction():
            gone = await conn.fetchval(
                "DELETE FROM blobstore.blobs b WHERE sha256 = $1 AND unreferenced_since IS NOT NULL "
                "AND unreferenced_since < now() - make_interval(secs => $2) "
                "AND NOT EXISTS (SELECT 1 FROM blobstore.refs r WHERE r.sha256 = b.sha256) "
                "AND NOT EXISTS (SELECT 1 FROM blobstore.attachments a WHERE a.sha256 = b.sha256) "
                "RETURNING true", sha256, grace_s)
        return bool(gone)

    @staticmethod
    async def is_orphan(conn: asyncpg.Connection, sha256: str) -> bool:
        return not await conn.fetchval("SELECT EXISTS (SELECT 1 FROM blobstore.blobs WHERE sha256 = $1)", sha256)


def chunks_of(items: Iterable[str], n: int) -> Iterable[list[str]]:
    batch: list[str] = []
    for x in items:
        batch.append(x)
        if len(batch) >= n:
            yield batch
            batch = []
    if batch:
        yield batch
