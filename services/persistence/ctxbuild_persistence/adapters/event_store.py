"""The event store on Postgres (schema ``persistence``): append with optimistic concurrency and idempotency,
outbox rows in the same transaction, reads by stream and by global position.

Global order: every append takes one transaction-level advisory lock (``pg_advisory_xact_lock``) before it
reads the stream version and inserts. Appends are therefore serialized, positions are assigned in commit
order and a reader paging by position never sees position n+1 before n. Simple and correct; the cost is one
appender at a time across all streams (fine at this scale — a per-stream lock plus a commit-ordered
projection/“stable position” watermark is the upgrade path if append throughput ever matters).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import asyncpg
from ctxbuild_platform.errors import Conflict
from ctxbuild_platform.postgres import postgres_errors

from ..domain.append import AppendPlan, NewEvent, StoredRef, plan_append
from .db import Database

APPEND_LOCK = 0x6374785F61707064  # 'ctx_appd'


def dumps(value: Any) -> str:
    """Compact JSON text as stored (``json`` columns keep these bytes, key order included)."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate came in as a \\ud8xx escape: keep it escaped
        text = json.dumps(value, separators=(",", ":"))
    return text


@asynccontextmanager
async def db_errors() -> AsyncIterator[None]:
    """The platform's classification (``ctxbuild_platform.postgres``: Postgres away or a transient conflict → a
    retryable ``unavailable``, a value out of range → ``invalid-payload``), plus the event store's own case."""
    try:
        async with postgres_errors("postgres"):
            yield
    except asyncpg.UniqueViolationError as exc:
        # the lock makes this unreachable for well-behaved writers; a backstop, never a silent overwrite
        raise Conflict(f"concurrent append: {exc.constraint_name or exc}", retryable=True) from exc


def _iso(ts: datetime) -> str:
    return ts.isoformat()


def row_to_event(row: asyncpg.Record) -> dict[str, Any]:
    return {
        "eventId": str(row["event_id"]),
        "streamId": row["stream_id"],
        "type": row["type"],
        "version": row["version"],
        "position": row["position"],
        "data": json.loads(row["data"]),
        "metadata": json.loads(row["metadata"]),
        "recordedAt": _iso(row["recorded_at"]),
    }


# the stream's current version and which of the request's event ids are stored (one row even when none is)
_STATE = (
    "SELECT c.current, e.event_id, e.stream_id, e.version, e.position "
    "FROM (SELECT coalesce(max(version), 0) AS current FROM persistence.events WHERE stream_id = $1) c "
    "LEFT JOIN persistence.events e ON e.event_id = ANY($2::uuid[])")

_SELECT = ("SELECT position, stream_id, version, event_id, type, data::text AS data, metadata::text AS metadata, "
           "recorded_at FROM persistence.events ")


# A page: the inner query runs a sum over the small size_bytes column (no event data is read for it) and keeps
# the events that start before the budget is used up and end within it — the first one always; the data of the
# kept events only is then read. One row more than ``limit`` is looked at to tell whether more remain.
_PAGE_STREAM = (
    "SELECT e.position, e.stream_id, e.version, e.event_id, e.type, e.data::text AS data, "
    "e.metadata::text AS metadata, e.recorded_at FROM ("
    "  SELECT position, n, sum(size_bytes) OVER (ORDER BY version) AS upto FROM ("
    "    SELECT position, version, size_bytes, row_number() OVER (ORDER BY version) AS n "
    "    FROM persistence.events WHERE stream_id = $1 AND version >= $2 ORDER BY version LIMIT $3) c"
    ") w JOIN persistence.events e USING (position) WHERE w.n = 1 OR w.upto <= $4 ORDER BY e.version")
_PAGE_ALL = (
    "SELECT e.position, e.stream_id, e.version, e.event_id, e.type, e.data::text AS data, "
    "e.metadata::text AS metadata, e.recorded_at, w.more FROM ("
    "  SELECT position, n, upto, "
    "         (count(*) OVER () > count(*) FILTER (WHERE (n = 1 OR upto <= $3) AND n <= $2) OVER ()) AS more FROM ("
    "    SELECT position, n, sum(size_bytes) OVER (ORDER BY position) AS upto FROM ("
    "      SELECT position, size_bytes, row_number() OVER (ORDER BY position) AS n "
    "      FROM persistence.events WHERE position > $1 ORDER BY position LIMIT $2 + 1) c) s"
    ") w JOIN persistence.events e USING (position) WHERE (w.n = 1 OR w.upto <= $3) AND w.n <= $2 "
    "ORDER BY e.position")


class EventStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def append(self, stream_id: str, expected_version: int | None, events: list[NewEvent]) -> dict[str, Any]:
        """Four round trips: BEGIN + lock, one read (stream version + stored ids), one write (events + outbox
        rows in one statement), COMMIT."""
        ids = [uuid.UUID(e.event_id) for e in events]
        async with db_errors(), self.db.pool.acquire() as conn:
            # BEGIN and the lock in one simple-protocol round trip; the read below is a new statement, so its
            # snapshot is taken after the lock is held (READ COMMITTED) and sees every earlier append
            await conn.execute(f"BEGIN; SELECT pg_advisory_xact_lock({APPEND_LOCK})")
            try:
                rows = await conn.fetch(_STATE, stream_id, ids)
                current = rows[0]["current"]
                existing = {str(r["event_id"]): StoredRef(r["stream_id"], r["version"], r["position"])
                            for r in rows if r["event_id"] is not None}
                plan = plan_append(stream_id, expected_version, events, current, existing)
                positions = await self._insert(conn, plan)
                await conn.execute("COMMIT")
            except BaseException:
                if not conn.is_closed():
                    try:
                        await conn.execute("ROLLBACK")
                    except Exception:  # noqa: BLE001 - the connection is broken; the pool discards it
                        conn.terminate()
                raise
        return plan.result(positions)

    @staticmethod
    async def _insert(conn: asyncpg.Connection, plan: AppendPlan) -> list[int]:
        if not plan.to_insert:
            return []
        rows = await conn.fetch(
            "WITH ins AS ("
            "  INSERT INTO persistence.events (stream_id, version, event_id, type, data, metadata) "
            "  SELECT $1, x.v, x.id, x.t, x.d::json, x.m::json "
            "  FROM unnest($2::int[], $3::uuid[], $4::text[], $5::text[], $6::text[]) "
            "       WITH ORDINALITY AS x(v, id, t, d, m, ord) "
            "  ORDER BY x.ord "
            "  RETURNING position, version), "
            "ob AS (INSERT INTO persistence.outbox (position) SELECT position FROM ins) "
            "SELECT position, version FROM ins",
            plan.stream_id,
            [v for v, _ in plan.to_insert],
            [uuid.UUID(e.event_id) for _, e in plan.to_insert],
            [e.type for _, e in plan.to_insert],
            [dumps(e.data) for _, e in plan.to_insert],
            [dumps(e.metadata) for _, e in plan.to_insert],
        )
        by_version = {r["version"]: r["position"] for r in rows}
        return [by_version[v] for v, _ in plan.to_insert]

    async def read_stream(self, stream_id: str, from_version: int, limit: int, max_bytes: int) -> dict[str, Any]:
        """A page of a stream from ``from_version``: whole events while their JSON fits ``max_bytes`` (at least
        one, so an event larger than the budget still moves), at most ``limit`` of them."""
        async with db_errors(), self.db.pool.acquire() as conn, \
                conn.transaction(isolation="repeatable_read", readonly=True):
            rows = await conn.fetch(_PAGE_STREAM, stream_id, from_version, limit, max_bytes)
            last = await conn.fetchval(
                "SELECT coalesce(max(version), 0) FROM persistence.events WHERE stream_id = $1", stream_id)
        events = [row_to_event(r) for r in rows]
        nxt = events[-1]["version"] + 1 if events else max(from_version, 1)
        return {"streamId": stream_id, "events": events, "lastVersion": last, "nextVersion": nxt,
                "more": nxt <= last}

    async def read_all(self, after_position: int, limit: int, max_bytes: int) -> dict[str, Any]:
        """A page of the log after ``after_position``, cut like :meth:`read_stream`; ``more`` when the page was
        cut (by the budget or the count) before the head of the log."""
        async with db_errors(), self.db.pool.acquire() as conn:
            rows = await conn.fetch(_PAGE_ALL, after_position, limit, max_bytes)
        more = bool(rows) and rows[0]["more"]
        events = [row_to_event(r) for r in rows]
        last = events[-1]["position"] if events else after_position
        return {"events": events, "lastPosition": last, "nextPosition": last, "more": more}

    async def event_at(self, position: int) -> dict[str, Any] | None:
        async with db_errors(), self.db.pool.acquire() as conn:
            row = await conn.fetchrow(_SELECT + "WHERE position = $1", position)
        return row_to_event(row) if row is not None else None

    async def stream_events(self, stream_id: str) -> list[dict[str, Any]]:
        """Every event of a stream, in version order (history folding)."""
        async with db_errors(), self.db.pool.acquire() as conn:
            rows = await conn.fetch(_SELECT + "WHERE stream_id = $1 ORDER BY version", stream_id)
        return [row_to_event(r) for r in rows]
