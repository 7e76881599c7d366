"""The conversation projection on Postgres: the projector (a background task of every replica), the history
read from the projection, and the rebuild command.

Exactly-once effect: one batch = one transaction that (1) locks the projection's row in
``persistence.projection_tracking`` (``FOR UPDATE SKIP LOCKED``: one replica projects at a time, the others
wait for the next round), (2) reads the events after its position in the log's commit order ((tx, position)
below the visibility horizon, ``event_store.VISIBLE_BELOW``: nothing can later appear before what was read), (3)
writes the projection rows and (4) moves the position (the last event applied; its tx is looked up). A crash
before the commit undoes all four, a crash after keeps all four.

Read-your-writes: ``ctx.persist.history`` looks up the log cursor ``(tx, position)`` of the conversation stream's
last event (with the stream's version and the projection's committed position, one statement), waits (bounded,
``history_projection_wait_s``) until the projection is at or past it — waking the projector — and reads the rows
in one snapshot together with the tracking position. A projection still behind after the wait (or failing) is
bypassed: the reply is folded from the events (``source: "fold"``), never stale. A short conversation
(``history_fold_max_events``) is always folded, the projection not read: its fold is one statement, the
projection's read a transaction of several.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import asyncpg
import structlog
from ctxbuild_platform.errors import NotFound
from ctxbuild_platform.postgres import UNAVAILABLE
from opentelemetry import metrics

from ..domain.conversation import PathWindow, history_reply, page_info
from ..domain.projection import (
    PROJECTION,
    Changes,
    ConvHead,
    Known,
    LogEvent,
    keys_of,
    project,
    unprojectable,
)
from .db import RELAXED, Database
from .event_store import VISIBLE_BELOW, cursor_tx, db_errors, dumps
from .worker import WakeableWorker

log = structlog.get_logger("projection")

TABLES = ("conversations", "messages", "compaction_summaries", "attachments", "file_references")
# ORDER BY of each table's snapshot (its primary key), used by rebuild --verify and the tests
TABLE_ORDER = {
    "conversations": "conversation_id",
    "messages": "conversation_id, message_id",
    "compaction_summaries": "conversation_id, boundary_id",
    "attachments": "conversation_id, handle",
    "file_references": "conversation_id, message_id, kind, ref",
}

# the next events in global order, at most $2 of them and — past the first — at most $3 bytes of data; only
# conversation streams' data is decoded (and sent)
_READ_EVENTS = f"""
SELECT position, tx::text::bigint AS tx, stream_id, version, type, data, upto FROM (
    SELECT position, tx, stream_id, version, type, d AS data, coalesce(octet_length(d), 0) AS own,
           sum(coalesce(octet_length(d), 0)) OVER (ORDER BY tx, position) AS upto
    FROM (SELECT position, tx, stream_id, version, type,
                 CASE WHEN stream_id LIKE 'conversation:%' THEN data::text END AS d
          FROM persistence.events WHERE (tx, position) > ({cursor_tx("$1")}, $1) AND tx < {VISIBLE_BELOW}
          ORDER BY tx, position LIMIT $2) page
) sized
WHERE upto - own < $3
ORDER BY tx, position"""
# the projection's position and the log cursor it stands for ((0, 0): nothing applied yet)
_TRACKING = ("SELECT t.position, coalesce(e.tx::text::bigint, 0) AS tx FROM persistence.projection_tracking t "
             "LEFT JOIN persistence.events e ON e.position = t.position WHERE t.name = $1")
# a projector round's, RELAXED: rows and tracking are lost together in a crash and projected again from the events
_TRACKING_RELAXED = ("SELECT t.position, coalesce(e.tx::text::bigint, 0) AS tx FROM " + RELAXED + ", "
                     "persistence.projection_tracking t LEFT JOIN persistence.events e ON e.position = t.position "
                     "WHERE t.name = $1 FOR UPDATE OF t SKIP LOCKED")
MAX_BATCH_BYTES = 16 * 1024 * 1024

# a no-op until the process configures a meter provider; the count is also in GET /projection
PARKED_COUNTER = metrics.get_meter("ctxbuild.persistence").create_counter(
    "ctxbuild.projection.parked_events", unit="{event}",
    description="events the conversation projection could not apply and parked (persistence.parked_events)")
# what a bad event can raise while being applied; Postgres being unavailable (ctxbuild_platform.postgres.UNAVAILABLE:
# the connection, a deadlock, a serialization failure, a cancelled statement) is not: the batch is retried
_APPLY_ERRORS = (asyncpg.PostgresError, ValueError, TypeError, KeyError, AttributeError, UnicodeError)


def _load(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _dump_or_none(value: Any) -> str | None:
    return None if value is None else dumps(value)


async def _stored(conn: asyncpg.Connection, table: str, column: str,
                  keys: Sequence[tuple[str, str]]) -> set[tuple[str, str]]:
    """Which of the (conversation id, ``column``) keys ``persistence.<table>`` already holds."""
    if not keys:
        return set()
    rows = await conn.fetch(
        f"SELECT t.conversation_id, t.{column} FROM persistence.{table} t JOIN unnest($1::text[], $2::text[]) "
        f"AS k(c, v) ON t.conversation_id = k.c AND t.{column} = k.v",
        [c for c, _ in keys], [v for _, v in keys])
    return {(r[0], r[1]) for r in rows}


async def apply_batch(conn: asyncpg.Connection, events: Sequence[LogEvent]) -> Changes:
    """Project ``events`` (position order) inside the caller's transaction; returns what was written."""
    keys = keys_of(events)
    heads: dict[str, ConvHead] = {}
    if keys.conversations:
        for r in await conn.fetch(
                "SELECT conversation_id, version, first_position, last_position, created, title, settings::text "
                "AS settings, last_message_id, message_count, attachment_count FROM persistence.conversations "
                "WHERE conversation_id = ANY($1::text[])", keys.conversations):
            heads[r["conversation_id"]] = ConvHead(
                r["conversation_id"], r["version"], r["first_position"], r["last_position"], r["created"],
                r["title"], _load(r["settings"]), r["last_message_id"], r["message_count"], r["attachment_count"])
    known = Known(await _stored(conn, "messages", "message_id", keys.messages),
                  await _stored(conn, "attachments", "handle", keys.handles),
                  await _stored(conn, "compaction_summaries", "boundary_id", keys.boundaries))

    ch = project(events, heads, known)
    await _write(conn, ch)
    return ch


def _printable(text: str) -> str:
    """A reason as storable text: no NUL, no lone surrogate (it may quote the bad value)."""
    return text.replace("\x00", "\\u0000").encode("utf-8", "backslashreplace").decode("utf-8")[:1000]


async def apply_isolated(conn: asyncpg.Connection, events: Sequence[LogEvent],
                         savepoints: bool = True) -> list[tuple[LogEvent, str]]:
    """Project ``events`` like :func:`apply_batch`, parking the ones the projection cannot apply instead of
    failing the batch (SPEC §15.3: one bad event must not stop the projection of every conversation). Known bad
    shapes are found before writing (:func:`unprojectable`, also enforced at append time); anything else that
    fails is found by applying the batch one event at a time, each in its own savepoint. Returns the parked
    events with their reasons (written to ``persistence.parked_events`` in the caller's transaction).
    Without ``savepoints`` the batch is applied as it is: a failure then aborts the caller's transaction, and the
    caller runs the batch again with them (two round trips fewer per batch when nothing fails)."""
    parked = [(ev, reason) for ev in events if (reason := unprojectable(ev)) is not None]
    skip = {ev.position for ev, _ in parked}
    good = [ev for ev in events if ev.position not in skip]
    if good and not savepoints:
        await apply_batch(conn, good)
    elif good:
        try:
            async with conn.transaction():  # a savepoint: a failure undoes this batch's rows only
                await apply_batch(conn, good)
        except UNAVAILABLE:
            raise
        except _APPLY_ERRORS:
            for ev in good:
                try:
                    async with conn.transaction():
                        await apply_batch(conn, [ev])
                except UNAVAILABLE:
                    raise
                except _APPLY_ERRORS as exc:
                    parked.append((ev, f"{ev.type}: {type(exc).__name__}: {exc}"))
    if parked:
        parked.sort(key=lambda p: p[0].position)
        await conn.execute(
            "INSERT INTO persistence.parked_events (position, event_id, stream_id, type, reason) "
            "SELECT e.position, e.event_id, e.stream_id, e.type, x.r "
            "FROM unnest($1::bigint[], $2::text[]) AS x(p, r) JOIN persistence.events e ON e.position = x.p "
            "ON CONFLICT (position) DO NOTHING",
            [ev.position for ev, _ in parked], [_printable(r) for _, r in parked])
    return parked


async def _write(conn: asyncpg.Connection, ch: Changes) -> None:
    if ch.heads:
        await conn.executemany(
            "INSERT INTO persistence.conversations (conversation_id, version, first_position, last_position, "
            "created, title, settings, last_message_id, message_count, attachment_count) "
            "VALUES ($1, $2, $3, $4, $5, $6, $7::json, $8, $9, $10) "
            "ON CONFLICT (conversation_id) DO UPDATE SET version = EXCLUDED.version, "
            "last_position = EXCLUDED.last_position, created = EXCLUDED.created, title = EXCLUDED.title, "
            "settings = EXCLUDED.settings, last_message_id = EXCLUDED.last_message_id, "
            "message_count = EXCLUDED.message_count, attachment_count = EXCLUDED.attachment_count",
            [(h.conversation_id, h.version, h.first_position, h.last_position, h.created, h.title,
              _dump_or_none(h.settings), h.last_message_id, h.message_count, h.attachment_count)
             for h in ch.heads.values()])
    if ch.messages:
        bodies = [dumps(m.body) for m in ch.messages]  # stored as is; size_bytes is these bytes (migration 0004)
        await conn.execute(
            "INSERT INTO persistence.messages (conversation_id, message_id, seq, parent_id, role, turn_id, body, "
            "usage, position, size_bytes, clear_context) "
            "SELECT c, id, s, p, r, t, b::json, u::json, pos, sz, cl FROM unnest($1::text[], $2::text[], $3::int[], "
            "$4::text[], $5::text[], $6::text[], $7::text[], $8::text[], $9::bigint[], $10::int[], $11::bool[]) "
            "AS x(c, id, s, p, r, t, b, u, pos, sz, cl)",
            [m.conversation_id for m in ch.messages], [m.message_id for m in ch.messages],
            [m.seq for m in ch.messages], [m.parent_id for m in ch.messages], [m.role for m in ch.messages],
            [m.turn_id for m in ch.messages], bodies,
            [_dump_or_none(m.usage) for m in ch.messages], [m.position for m in ch.messages],
            [m.size_bytes(b) for m, b in zip(ch.messages, bodies, strict=True)],
            [m.clear_context for m in ch.messages])
    await _insert_rows(conn, "compaction_summaries", ch.summaries)
    await _insert_rows(conn, "attachments", ch.attachments)
    await _insert_rows(conn, "file_references", ch.file_refs)


async def _insert_rows(conn: asyncpg.Connection, table: str, rows: Sequence[Any]) -> None:
    """``rows`` (one row dataclass of ``domain/projection.py``, whose fields are the columns) into
    ``persistence.<table>``."""
    if not rows:
        return
    columns = [f.name for f in dataclasses.fields(rows[0])]
    await conn.executemany(
        f"INSERT INTO persistence.{table} ({', '.join(columns)}) "
        f"VALUES ({', '.join(f'${i}' for i in range(1, len(columns) + 1))})",
        [tuple(getattr(r, c) for c in columns) for r in rows])


async def read_page(conn: asyncpg.Connection, after: int, limit: int,
                    max_bytes: int = MAX_BATCH_BYTES) -> tuple[list[LogEvent], bool]:
    """Up to ``limit`` events after the event at position ``after`` (0: the start) in log order, cut once their
    conversation data passes ``max_bytes`` (one event at least): a batch of large AssistantMessageCompleted
    events stays bounded in memory. And whether the page is full — ``limit`` events, or cut by the byte budget
    (then the data read reaches it) — so more may follow; a page that is not full holds every event visible."""
    rows = await conn.fetch(_READ_EVENTS, after, limit, max_bytes)
    events = [LogEvent(r["position"], r["stream_id"], r["version"], r["type"], _load(r["data"]), r["tx"])
              for r in rows]
    return events, len(rows) >= limit or (bool(rows) and rows[-1]["upto"] >= max_bytes)


async def read_events(conn: asyncpg.Connection, after: int, limit: int,
                      max_bytes: int = MAX_BATCH_BYTES) -> list[LogEvent]:
    """:func:`read_page`'s events."""
    return (await read_page(conn, after, limit, max_bytes))[0]


class Projector(WakeableWorker):
    """Keeps the conversation projection up to date; one instance per replica, one batch at a time overall.
    A stop mid-batch rolls the open batch back with its connection: nothing half-applied."""

    task_name = "projector"

    def __init__(self, db: Database, *, batch_size: int = 500, batch_bytes: int = MAX_BATCH_BYTES,
                 poll_interval_s: float = 1.0, max_backoff_s: float = 5.0, min_interval_s: float = 0.0) -> None:
        super().__init__(db, batch_size=batch_size, poll_interval_s=poll_interval_s, max_backoff_s=max_backoff_s,
                         min_interval_s=min_interval_s)
        self.batch_bytes = batch_bytes
        self.position = 0  # last tracking position this replica saw committed
        self.cursor: tuple[int, int] = (0, 0)  # its place in the log: (tx, position)
        self.events_applied = 0  # by this replica (metrics, tests)
        self.events_parked = 0  # by this replica; persistence.parked_events has them all
        self._progress = asyncio.Condition()
        self._waiters = 0
        self._page_full = False  # the last round's page was full: more may be waiting

    # ---------- work ----------
    async def project_once(self) -> int | None:
        """One batch. Returns how many events were read (0 = caught up), None if another replica holds the
        projection (its progress is picked up by the next round). The batch is applied as one; should an event
        fail it, the round runs again with each event in a savepoint (the failing ones parked)."""
        try:
            return await self._project_once(savepoints=False)
        except UNAVAILABLE:
            raise
        except _APPLY_ERRORS:
            return await self._project_once(savepoints=True)

    async def _project_once(self, savepoints: bool) -> int | None:
        async with self.db.pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(_TRACKING_RELAXED, PROJECTION)
            if row is None:
                row = await conn.fetchrow(_TRACKING, PROJECTION)
                await self._advance((row["tx"], row["position"]) if row is not None else (0, 0))
                return None
            pos, cursor = row["position"], (row["tx"], row["position"])
            events, self._page_full = await read_page(conn, pos, self.batch_size, self.batch_bytes)
            parked: list[tuple[LogEvent, str]] = []
            if events:
                parked = await apply_isolated(conn, events, savepoints)
                pos, cursor = events[-1].position, events[-1].cursor
                await conn.execute(
                    "UPDATE persistence.projection_tracking SET position = $2, updated_at = now(), last_error = NULL "
                    "WHERE name = $1", PROJECTION, pos)
        self.events_applied += len(events) - len(parked)
        for ev, reason in parked:  # committed: alert once per parked event
            self.events_parked += 1
            PARKED_COUNTER.add(1, {"event.type": ev.type})
            log.error("projection-event-parked", position=ev.position, stream_id=ev.stream_id, event_type=ev.type,
                      reason=_printable(reason))
        await self._advance(cursor)
        return len(events)

    async def _advance(self, cursor: tuple[int, int]) -> None:
        async with self._progress:
            if cursor > self.cursor:
                self.cursor, self.position = cursor, cursor[1]
            self._progress.notify_all()

    async def wait_for(self, cursor: tuple[int, int], timeout: float) -> bool:
        """True once the projection is at or past the log cursor ``(tx, position)`` (bounded by ``timeout``)."""
        if self.cursor >= cursor:
            return True
        self._waiters += 1
        self.wake(urgent=True)  # a reader waits: no coalescing delay
        try:
            async with self._progress:
                await asyncio.wait_for(self._progress.wait_for(lambda: self.cursor >= cursor), timeout)
            return True
        except TimeoutError:
            return False
        finally:
            self._waiters -= 1

    @property
    def readers_waiting(self) -> int:
        """History reads waiting in :meth:`wait_for` right now."""
        return self._waiters

    async def status(self) -> dict[str, Any]:
        """The projection's position, its last error and how many events it parked (GET /projection)."""
        async with db_errors(), self.db.pool.acquire() as conn:
            row = await conn.fetchrow(
                "SELECT t.position, t.last_error, t.updated_at, (SELECT count(*) FROM persistence.parked_events) "
                "AS parked FROM persistence.projection_tracking t WHERE t.name = $1", PROJECTION)
        if row is None:
            return {"projection": PROJECTION, "position": 0, "parkedEvents": 0, "lastError": None}
        return {"projection": PROJECTION, "position": row["position"], "parkedEvents": row["parked"],
                "lastError": row["last_error"], "updatedAt": row["updated_at"].isoformat()}

    async def _record_error(self, error: str) -> None:
        try:
            async with self.db.pool.acquire() as conn:
                await conn.execute("UPDATE persistence.projection_tracking SET last_error = $2 WHERE name = $1",
                                   PROJECTION, error[:1000])
        except Exception as exc:  # noqa: BLE001 - best effort: the log line is the primary report
            log.debug("projection-error-not-recorded", error=str(exc)[:200])

    async def round(self) -> int | None:
        return await self.project_once()

    def more(self, done: int | None) -> bool:
        # a page that was not full read every visible event: a later commit wakes the loop (an empty round cost a
        # transaction and two reads after every batch)
        return bool(done) and self._page_full

    def idle_timeout(self, done: int | None) -> float:
        # someone waits for it: another replica is projecting (None), or the awaited event is not visible yet (the
        # log stops before a transaction still running, e.g. the relay's) — poll quickly
        return 0.05 if self.readers_waiting else self.poll_interval_s

    async def failed(self, error: str, retry_in_s: float) -> None:
        # history falls back to folding while this is failing
        log.warning("projection-failed", error=error, retry_in_s=retry_in_s)
        await self._record_error(error)


# ---------------------------------------------------------------- reads

@dataclasses.dataclass(frozen=True, slots=True)
class StreamHead:
    """Where a stream ends and where the projection stood, read in one statement."""

    cursor: tuple[int, int]  # log cursor (tx, position) of the stream's last event ((0, 0): no events)
    version: int  # the stream's version (0: no events)
    projected: tuple[int, int]  # log cursor of the last event the projection has committed ((0, 0): none)


_STREAM_HEAD = """
SELECT h.tx, h.position, h.version, p.tx AS projected_tx, p.position AS projected_position
FROM (SELECT 1) one
LEFT JOIN (SELECT tx::text::bigint AS tx, position, version FROM persistence.events WHERE stream_id = $1
           ORDER BY version DESC LIMIT 1) h ON true
LEFT JOIN (SELECT t.position, coalesce(e.tx::text::bigint, 0) AS tx FROM persistence.projection_tracking t
           LEFT JOIN persistence.events e ON e.position = t.position WHERE t.name = $2) p ON true
"""


async def stream_head(db: Database, stream_id: str) -> StreamHead:
    """The stream's last event (log cursor, version) and the projection's committed position, in one round trip:
    the projection may be further than this replica's projector knows (another replica projected it)."""
    async with db_errors(), db.pool.acquire() as conn:
        row = await conn.fetchrow(_STREAM_HEAD, stream_id, PROJECTION)
    return StreamHead((row["tx"] or 0, row["position"] or 0), row["version"] or 0,
                      (row["projected_tx"] or 0, row["projected_position"] or 0))


# One page of the path, walked from the anchor towards the root over the primary key (one index lookup per
# message): whole messages while the running size fits $3 (the anchor always), ending early at the window's own
# end — $4 (turn start): the deepest compaction boundary or a clear-context marker; $5 > 0 (maxMessages): a
# clear-context marker, or a user row once $5 rows are taken. Cost: O(messages in the page), whatever the
# history's length.
_PATH = """
WITH RECURSIVE path(message_id, parent_id, depth, acc, stop) AS (
    SELECT m.message_id, m.parent_id, 0, m.size_bytes::bigint,
           (($4 OR $5 > 0) AND m.clear_context)
           OR ($4 AND EXISTS (SELECT 1 FROM persistence.compaction_summaries b
                              WHERE b.conversation_id = $1 AND b.boundary_id = m.message_id))
           OR ($5 > 0 AND 1 >= $5 AND m.role = 'user')
    FROM persistence.messages m WHERE m.conversation_id = $1 AND m.message_id = $2
  UNION ALL
    SELECT m.message_id, m.parent_id, p.depth + 1, p.acc + m.size_bytes,
           (($4 OR $5 > 0) AND m.clear_context)
           OR ($4 AND EXISTS (SELECT 1 FROM persistence.compaction_summaries b
                              WHERE b.conversation_id = $1 AND b.boundary_id = m.message_id))
           OR ($5 > 0 AND p.depth + 2 >= $5 AND m.role = 'user')
    FROM path p JOIN persistence.messages m ON m.conversation_id = $1 AND m.message_id = p.parent_id
    WHERE NOT p.stop AND p.acc + m.size_bytes <= $3
) CYCLE message_id SET is_cycle USING walked
SELECT m.message_id, m.parent_id, m.clear_context, p.stop, m.body::text AS body, s.summary,
       (p.parent_id IS NOT NULL AND EXISTS (SELECT 1 FROM persistence.messages x
                                            WHERE x.conversation_id = $1 AND x.message_id = p.parent_id)) AS has_parent
FROM path p
JOIN persistence.messages m ON m.conversation_id = $1 AND m.message_id = p.message_id
LEFT JOIN persistence.compaction_summaries s ON s.conversation_id = $1 AND s.boundary_id = p.message_id
WHERE NOT p.is_cycle
ORDER BY p.depth DESC
"""

# is there a clear-context marker among the ancestors of $2? Only asked when the conversation has a marker older
# than $2 at all (a partial index answers that), then walked until the nearest marker.
_CLEARED_BEFORE = """
SELECT EXISTS (SELECT 1 FROM persistence.messages c JOIN persistence.messages b
                 ON b.conversation_id = c.conversation_id AND b.message_id = $2
               WHERE c.conversation_id = $1 AND c.clear_context AND c.seq < b.seq)
"""
_CLEAR_ANCESTOR = """
WITH RECURSIVE up(message_id, parent_id, clear) AS (
    SELECT message_id, parent_id, clear_context FROM persistence.messages
    WHERE conversation_id = $1 AND message_id = $2
  UNION ALL
    SELECT m.message_id, m.parent_id, m.clear_context
    FROM up u JOIN persistence.messages m ON m.conversation_id = $1 AND m.message_id = u.parent_id
    WHERE NOT u.clear
) CYCLE message_id SET is_cycle USING walked
SELECT coalesce(bool_or(clear), false) FROM up WHERE NOT is_cycle
"""

Resolve = Callable[[list[dict[str, Any]]], Awaitable[list[dict[str, Any]]]]


async def read_history(db: Database, conversation_id: str, anchor_id: str | None, at_least: tuple[int, int],
                       include_branches: bool, window: PathWindow, resolve: Resolve) -> dict[str, Any] | None:
    """The history reply from the projection, or None when the projection is not yet at ``at_least``. One
    page of the path (``window``); ``resolve`` reads back message parts stored by content reference."""
    async with db_errors(), db.pool.acquire() as conn, \
            conn.transaction(isolation="repeatable_read", readonly=True):
        # a conversation with a parked event is not whole in the projection: its history is folded instead
        tracking = await conn.fetchrow(
            "SELECT t.position, coalesce(e.tx::text::bigint, 0) AS tx, "
            "       EXISTS (SELECT 1 FROM persistence.parked_events WHERE stream_id = $2) AS parked "
            "FROM persistence.projection_tracking t LEFT JOIN persistence.events e ON e.position = t.position "
            "WHERE t.name = $1", PROJECTION, f"conversation:{conversation_id}")
        if tracking is None or (tracking["tx"], tracking["position"]) < at_least or tracking["parked"]:
            return None
        head = await conn.fetchrow(
            "SELECT version, title, last_message_id FROM persistence.conversations WHERE conversation_id = $1",
            conversation_id)
        if head is None:
            raise NotFound(f"conversation {conversation_id!r} has no events",
                           details={"conversationId": conversation_id})
        anchor = anchor_id if anchor_id is not None else head["last_message_id"]
        messages: list[dict[str, Any]] = []
        start, cleared = "root", False
        if anchor is not None:
            # a cached generic plan of the walk knows no conversation: it hashes every message of the average
            # conversation on each step (O(history)); a plan made for these values walks the primary key
            await conn.execute("SET LOCAL plan_cache_mode = force_custom_plan")
            rows = await conn.fetch(_PATH, conversation_id, anchor, window.max_bytes, window.stop_at_summary,
                                    window.max_messages)
            if not rows:
                raise NotFound(f"message {anchor_id!r} is not in conversation {conversation_id!r}",
                               details={"conversationId": conversation_id, "anchorId": anchor_id})
            for r in rows:
                msg = json.loads(r["body"])
                if r["summary"] is not None:
                    msg["compactionSummary"] = r["summary"]
                messages.append(msg)
            first = rows[0]
            if first["stop"]:
                start = "clear" if first["clear_context"] else "summary" if (
                    window.stop_at_summary and first["summary"] is not None) else "limit"
            elif first["has_parent"]:
                start = "page"
            if start == "summary" and await conn.fetchval(_CLEARED_BEFORE, conversation_id, first["message_id"]):
                cleared = await conn.fetchval(_CLEAR_ANCESTOR, conversation_id, first["parent_id"]) \
                    if first["parent_id"] is not None else False
        atts = await conn.fetch(
            "SELECT sha256, handle, display_name, media_type, size FROM persistence.attachments "
            "WHERE conversation_id = $1 ORDER BY seq", conversation_id)
        branches = None
        if include_branches and messages:
            branches = await _branches(conn, conversation_id, [m["id"] for m in messages])
    attachments = [{"sha256": a["sha256"], "handle": a["handle"], "displayName": a["display_name"],
                    "mediaType": a["media_type"], "size": a["size"]} for a in atts]
    messages = await resolve(messages)
    reply = history_reply(conversation_id, head["version"], head["title"], messages, attachments,
                          source="projection", page=page_info(messages, start, cleared))
    if branches is not None:
        reply["branches"] = branches
    return reply


async def _branches(conn: asyncpg.Connection, conversation_id: str, path_ids: list[str]) -> dict[str, list[str]]:
    rows = await conn.fetch(
        "SELECT p.message_id AS on_path, array_agg(s.message_id ORDER BY s.seq) AS siblings "
        "FROM persistence.messages p JOIN persistence.messages s ON s.conversation_id = p.conversation_id "
        "  AND s.parent_id IS NOT DISTINCT FROM p.parent_id "
        "WHERE p.conversation_id = $1 AND p.message_id = ANY($2::text[]) GROUP BY p.message_id "
        "HAVING count(*) > 1", conversation_id, path_ids)
    by_id = {r["on_path"]: list(r["siblings"]) for r in rows}
    return {mid: by_id[mid] for mid in path_ids if mid in by_id}


# ---------------------------------------------------------------- rebuild

async def snapshot(conn: asyncpg.Connection) -> dict[str, list[tuple]]:
    """Every projection row, json as text, in primary-key order (for rebuild --verify and tests)."""
    out: dict[str, list[tuple]] = {}
    for table in TABLES:
        cols = [r["attname"] for r in await conn.fetch(
            "SELECT attname FROM pg_attribute WHERE attrelid = $1::regclass AND attnum > 0 AND NOT attisdropped "
            "ORDER BY attnum", f"persistence.{table}")]
        sel = ", ".join(f"{c}::text" for c in cols)
        out[table] = [tuple(r) for r in await conn.fetch(
            f"SELECT {sel} FROM persistence.{table} ORDER BY {TABLE_ORDER[table]}")]
    return out


def diff(before: dict[str, list[tuple]], after: dict[str, list[tuple]]) -> dict[str, dict[str, int]]:
    """Per table: rows only in ``before`` (missing after the rebuild) and only in ``after`` (extra)."""
    out: dict[str, dict[str, int]] = {}
    for table in TABLES:
        b, a = set(before.get(table, [])), set(after.get(table, []))
        if b != a:
            out[table] = {"missing": len(b - a), "extra": len(a - b)}
    return out


class _VerifyRollback(Exception):
    pass


async def rebuild(db: Database, *, verify: bool = False, batch_size: int = 1000,
                  lock_timeout_s: float = 30.0) -> dict[str, Any]:
    """Rebuild the conversation projection from the event log in ONE transaction (readers keep seeing the old
    rows until it commits; the live projectors wait on the tracking row meanwhile).

    The rows are first rebuilt up to the position the live projection had reached, so the two can be compared
    (``verify``: compare, report, roll back — a dry run); then, unless verifying, the rebuild continues to the
    head of the log and commits."""
    started = time.monotonic()
    report: dict[str, Any] = {"projection": PROJECTION, "verify": verify}
    try:
        async with db.pool.acquire() as conn, conn.transaction():
            await conn.execute(f"SET LOCAL lock_timeout = '{int(lock_timeout_s * 1000)}ms'")
            tracked = await conn.fetchrow(_TRACKING + " FOR UPDATE OF t", PROJECTION)
            if tracked is None:
                raise RuntimeError("projection_tracking has no 'conversation' row: run the migrations first")
            before = await snapshot(conn)
            for table in reversed(TABLES):
                await conn.execute(f"DELETE FROM persistence.{table}")
            await conn.execute("DELETE FROM persistence.parked_events")
            live, live_cursor = tracked["position"], (tracked["tx"], tracked["position"])
            pos, cursor, events_read = 0, (0, 0), 0
            while cursor < live_cursor:
                events = [e for e in await read_events(conn, pos, batch_size) if e.cursor <= live_cursor]
                if not events:
                    break
                await apply_isolated(conn, events)
                pos, cursor = events[-1].position, events[-1].cursor
                events_read += len(events)
            after = await snapshot(conn)
            report.update(livePosition=live, differences=diff(before, after),
                          rows={t: len(after[t]) for t in TABLES})
            report["identical"] = not report["differences"]
            if verify:
                raise _VerifyRollback
            pos = live
            while True:
                events = await read_events(conn, pos, batch_size)
                if not events:
                    break
                await apply_isolated(conn, events)
                pos = events[-1].position
                events_read += len(events)
            await conn.execute(
                "UPDATE persistence.projection_tracking SET position = $2, updated_at = now(), last_error = NULL "
                "WHERE name = $1", PROJECTION, pos)
            report.update(position=pos, eventsRead=events_read)
    except _VerifyRollback:
        report["rolledBack"] = True
    report["durationS"] = round(time.monotonic() - started, 3)
    return report
