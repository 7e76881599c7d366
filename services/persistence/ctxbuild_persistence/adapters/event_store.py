"""The event store on Postgres (schema ``persistence``): append with optimistic concurrency and idempotency,
outbox rows in the same transaction, reads by stream and by the global log.

No global append lock. ``position`` (a sequence) identifies an event; the global log is ordered by
``(tx, position)``, ``tx`` being the id of the transaction that wrote the row (xid8, migration 0005). A log reader
only takes rows whose ``tx`` is below :data:`VISIBLE_BELOW` — the oldest transaction still running in its snapshot
— so every transaction that could still add a row before the reader's cursor has ended: a cursor never skips a
late commit. The price: a long-running transaction anywhere in the database holds log readers back until it
ends (appends go on). Positions are unique, not gap-free and not increasing along the log.

An append is one statement in most cases (stream version check + events + outbox rows, autocommitted); a unique
violation (a concurrent writer, a retried id) or a version mismatch falls back to a read-then-insert
transaction that gives the exact answer (duplicates, ``version-conflict``, ``event-id-conflict``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
from ctxbuild_platform.errors import Conflict, DependencyUnavailable, InvalidPayload
from ctxbuild_platform.postgres import postgres_errors

from ..domain.append import AppendPlan, NewEvent, StoredRef, plan_append
from .db import Database

# the commit-order horizon of the statement's snapshot: the oldest transaction still running (the caller's own
# excluded: a reader's own transaction never writes events), or the snapshot's xmax when none is
VISIBLE_BELOW = ("(SELECT coalesce((SELECT min(x) FROM pg_snapshot_xip(s) AS x), pg_snapshot_xmax(s)) "
                 "FROM pg_current_snapshot() AS s)")


def cursor_tx(param: str) -> str:
    """The transaction id of the event at position ``param`` — a log cursor is (tx, position) of the last event
    read; position 0 is the start. NULL when no event has that position."""
    return (f"(SELECT CASE WHEN {param}::bigint = 0 THEN '0'::xid8 "
            f"ELSE (SELECT tx FROM persistence.events WHERE position = {param}::bigint) END)")


FAST_PATH_VERSIONS = 2**31 - 1  # expected versions the one-statement path can bind (integer column)
SLOW_PATH_ATTEMPTS = 5


# what json.dumps(value, ensure_ascii=False, separators=(",", ":")) builds per call, built once
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_COMPACT_ASCII = json.JSONEncoder(separators=(",", ":"))


def encode(value: Any) -> tuple[str, int]:
    """Compact JSON text as stored (``json`` columns keep these bytes, key order included) and its size in UTF-8
    bytes. A lone surrogate (it came in as a \\ud8xx escape) has no UTF-8 form: such text is kept escaped."""
    text = _COMPACT.encode(value)
    if text.isascii():  # O(1) in CPython: no encoding needed to know the size
        return text, len(text)
    try:
        return text, len(text.encode("utf-8"))
    except UnicodeEncodeError:
        text = _COMPACT_ASCII.encode(value)
        return text, len(text)


def dumps(value: Any) -> str:
    """The stored JSON text of ``value`` (:func:`encode`)."""
    return encode(value)[0]


def stored_texts(event: NewEvent) -> tuple[str, str]:
    """``data`` and ``metadata`` as stored: the text the append's checks already encoded, else encoded now."""
    return (event.data_json if event.data_json is not None else dumps(event.data),
            event.metadata_json if event.metadata_json is not None else dumps(event.metadata))


@asynccontextmanager
async def db_errors() -> AsyncIterator[None]:
    """The platform's classification (``ctxbuild_platform.postgres``: Postgres away or a transient conflict → a
    retryable ``unavailable``, a value out of range → ``invalid-payload``), plus the event store's own case."""
    try:
        async with postgres_errors("postgres"):
            yield
    except asyncpg.UniqueViolationError as exc:
        # a concurrent writer won every retry of the append (see EventStore.append); never a silent overwrite
        raise Conflict(f"concurrent append: {exc.constraint_name or exc}", retryable=True) from exc


def _iso(ts: datetime) -> str:
    return ts.isoformat()


def event_json(row: asyncpg.Record) -> str:
    """``dumps(row_to_event(row))`` without decoding ``data`` and ``metadata``: their stored text is spliced in as
    is, so what is published is what was stored, byte for byte (``data::text`` and ``metadata::text`` of a
    ``json`` column are the bytes appended)."""
    return (f'{{"eventId":"{row["event_id"]}","streamId":{dumps(row["stream_id"])},"type":{dumps(row["type"])},'
            f'"version":{row["version"]},"position":{row["position"]},"data":{row["data"]},'
            f'"metadata":{row["metadata"]},"recordedAt":"{_iso(row["recorded_at"])}"}}')


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
# kept events only is then read. One statement (one snapshot, no explicit transaction) also gives the stream's last
# version, on a row of its own even for an empty page.
_PAGE_STREAM = (
    "WITH l AS (SELECT coalesce(max(version), 0) AS last FROM persistence.events WHERE stream_id = $1) "
    "SELECT l.last, p.* FROM l LEFT JOIN LATERAL ("
    "  SELECT e.position, e.stream_id, e.version, e.event_id, e.type, e.data::text AS data, "
    "         e.metadata::text AS metadata, e.recorded_at FROM ("
    "    SELECT position, n, sum(size_bytes) OVER (ORDER BY version) AS upto FROM ("
    "      SELECT position, version, size_bytes, row_number() OVER (ORDER BY version) AS n "
    "      FROM persistence.events WHERE stream_id = $1 AND version >= $2 ORDER BY version LIMIT $3) c"
    "  ) w JOIN persistence.events e USING (position) WHERE w.n = 1 OR w.upto <= $4"
    ") p ON true ORDER BY p.version")
# The log after a cursor, in (tx, position) order, below the visibility horizon; one row even for an empty page
# (``known``: the cursor names an event).
_PAGE_ALL = (
    "WITH c AS (SELECT " + cursor_tx("$1") + " AS tx, " + VISIBLE_BELOW + " AS below) "
    "SELECT c.tx IS NOT NULL AS known, p.* FROM c LEFT JOIN LATERAL ("
    "  SELECT e.position, e.stream_id, e.version, e.event_id, e.type, e.data::text AS data, "
    "         e.metadata::text AS metadata, e.recorded_at, w.more, w.n FROM ("
    "    SELECT position, n, upto, "
    "           (count(*) OVER () > count(*) FILTER (WHERE (n = 1 OR upto <= $3) AND n <= $2) OVER ()) AS more "
    "    FROM (SELECT position, n, sum(size_bytes) OVER (ORDER BY n) AS upto FROM ("
    "      SELECT position, size_bytes, row_number() OVER (ORDER BY tx, position) AS n "
    "      FROM persistence.events WHERE (tx, position) > (c.tx, $1) AND tx < c.below "
    "      ORDER BY tx, position LIMIT $2 + 1) r) s"
    "  ) w JOIN persistence.events e USING (position) WHERE (w.n = 1 OR w.upto <= $3) AND w.n <= $2"
    ") p ON true ORDER BY p.n")

# The one-statement append of a group of requests, each on its own streams (a single append is one part, a batch
# several, each part on its own stream): each stream's version, then — for the requests whose every part has the
# expected version ($2: NULL = any; $9: the part's request) — their events (versions in part order) and outbox
# rows, so a batch is all or nothing. Rows per part (i = its 1-based index): one per inserted event, or one with a
# NULL position when its request was not written.
_GROUP_APPEND = (
    "WITH cur AS ("
    "  SELECT r.i, r.b, r.stream_id, r.expected, (SELECT coalesce(max(e.version), 0) FROM persistence.events e "
    "                                             WHERE e.stream_id = r.stream_id) AS v "
    "  FROM unnest($1::text[], $2::integer[], $9::integer[]) WITH ORDINALITY AS r(stream_id, expected, b, i)), "
    "ok AS ("
    "  SELECT c.i FROM cur c WHERE NOT EXISTS (SELECT 1 FROM cur d WHERE d.b = c.b AND d.expected IS NOT NULL "
    "                                          AND d.v <> d.expected)), "
    "ins AS ("
    "  INSERT INTO persistence.events (stream_id, version, event_id, type, data, metadata) "
    "  SELECT cur.stream_id, cur.v + x.k, x.id, x.t, x.d::json, x.m::json "
    "  FROM unnest($3::integer[], $4::integer[], $5::uuid[], $6::text[], $7::text[], $8::text[]) "
    "       WITH ORDINALITY AS x(i, k, id, t, d, m, ord) "
    "  JOIN cur ON cur.i = x.i JOIN ok ON ok.i = x.i "
    "  ORDER BY x.ord "
    "  RETURNING position, stream_id, version), "
    "ob AS (INSERT INTO persistence.outbox (position) SELECT position FROM ins) "
    "SELECT cur.i, cur.v AS current, ins.position FROM cur LEFT JOIN ins ON ins.stream_id = cur.stream_id "
    "ORDER BY cur.i, ins.version")
GROUP_MAX_REQUESTS = 64  # parts (streams) per statement
GROUP_MAX_EVENTS = 2000
# groups written at once, at most (CTX_APPEND_WRITERS). 1 on a box where Postgres shares the cores with the
# service: more writers did not raise events/s there and cost more CPU per event (docs/scaling.md); more pay where
# commits wait on a slow WAL flush rather than on CPU
APPEND_WRITERS = 1
# a group written beside another one holds at least this many requests: small concurrent groups cost a statement and
# a commit each (with every free writer taking what was queued, commits per event rose fivefold and events/s fell),
# so a second group starts only once enough has queued behind the first
CONCURRENT_GROUP_MIN = 8


@dataclass(frozen=True)
class AppendPart:
    """One stream's share of an append: a single append is one part, a batch (``ctx.persist.append_batch``) one
    per stream."""

    stream_id: str
    expected_version: int | None
    events: list[NewEvent]


@dataclass
class _Pending:
    parts: list[AppendPart]
    done: asyncio.Future
    streams: frozenset[str]
    size: int  # events


class EventStore:
    """Appends that arrive while groups are being written are written together, in one statement and one commit
    (group commit: concurrent appends cost one round trip and one WAL flush between them, not one each); an
    append alone is written at once. Up to ``writers`` groups are written at once, each on its own connection
    (their commits overlap and Postgres flushes their WAL together); a group goes beside others only when it holds
    ``concurrent_min`` requests, else they wait for the next free writer. A request that shares a stream with a
    group in flight, or with an earlier request still waiting, waits for a later group, so a stream's versions are
    read after the earlier write and its requests are written in arrival order. A batch of parts on several streams is
    one such request: all or nothing."""

    def __init__(self, db: Database, writers: int = APPEND_WRITERS,
                 concurrent_min: int = CONCURRENT_GROUP_MIN) -> None:
        self.db = db
        self.writers = max(1, writers)
        self.concurrent_min = max(1, concurrent_min)
        self._queue: list[_Pending] = []
        self._busy: set[str] = set()  # streams of the groups in flight (disjoint: see _take_group)
        self._inflight: dict[asyncio.Task, list[_Pending]] = {}  # writer → the group it writes
        self._closed = False

    async def append(self, stream_id: str, expected_version: int | None, events: list[NewEvent]) -> dict[str, Any]:
        """Store ``events`` on ``stream_id`` (rules: :mod:`..domain.append`)."""
        return (await self.append_batch([AppendPart(stream_id, expected_version, events)]))[0]

    async def append_batch(self, parts: list[AppendPart]) -> list[dict[str, Any]]:
        """Store every part in one commit, or none (each part by the rules of :mod:`..domain.append`; the first
        part whose version or event ids conflict raises and nothing is stored). One statement (grouped with
        concurrent appends) when the request is new and the versions match; otherwise the exact answer from
        :meth:`_append_checked`. Stream ids must be distinct (the caller checks)."""
        if self._closed:
            raise DependencyUnavailable("the event store is shutting down; retry")
        if all(p.expected_version is None or 0 <= p.expected_version <= FAST_PATH_VERSIONS for p in parts):
            pending = _Pending(parts, asyncio.get_running_loop().create_future(),
                               frozenset(x.stream_id for x in parts), sum(len(x.events) for x in parts))
            self._queue.append(pending)
            self._dispatch()
            async with db_errors():
                results = await pending.done
            if results is not None:
                return results
        for _ in range(SLOW_PATH_ATTEMPTS):
            results = await self._append_checked(parts)
            if results is not None:
                return results
        streams = [p.stream_id for p in parts]
        raise Conflict(f"concurrent appends to {', '.join(map(repr, streams))} kept winning; retry", retryable=True,
                       details={"streamId": streams[0]} if len(streams) == 1 else {"streamIds": streams})

    async def close(self) -> None:
        """Stop the writers; every waiting append (queued or in a group in flight) gets a retryable
        ``unavailable`` (a group cut short may have committed: its retry finds the ids stored)."""
        self._closed = True
        writers = list(self._inflight)
        for task in writers:
            task.cancel()
        await asyncio.gather(*writers, return_exceptions=True)
        # a writer cancelled before its first step never ran its handler: its group is still listed
        self._fail_all([p for group in self._inflight.values() for p in group])
        self._inflight.clear()

    def _dispatch(self) -> None:
        """Start writers while one is free and a group can be formed (any size when no group is in flight)."""
        while len(self._inflight) < self.writers:
            group = self._take_group(1 if not self._inflight else self.concurrent_min)
            if not group:
                return
            task = asyncio.get_running_loop().create_task(self._write_groups(), name="event-store-group-append")
            self._inflight[task] = group

    def _take_group(self, least: int) -> list[_Pending]:
        """Take a group of at least ``least`` requests off the queue (in arrival order, within the size limits) and
        mark its streams busy; none when fewer can go. A request touching a stream busy in flight, already in the
        group or of an earlier request left waiting stays queued: the groups in flight never share a stream, and a
        stream's requests are written in order."""
        group: list[_Pending] = []
        rest: list[_Pending] = []
        held = set(self._busy)
        taken: set[str] = set()
        n_parts = n_events = 0
        for p in self._queue:
            if p.streams & held or p.streams & taken or (group and (
                    n_parts + len(p.parts) > GROUP_MAX_REQUESTS or n_events + p.size > GROUP_MAX_EVENTS)):
                rest.append(p)
                held |= p.streams
            else:
                group.append(p)
                taken |= p.streams
                n_parts += len(p.parts)
                n_events += p.size
        if len(group) < least:
            return []
        self._queue = rest
        self._busy |= taken
        return group

    async def _write_groups(self) -> None:
        """Write this writer's group, answer each request, free its streams; then the next group the queue
        holds, until there is none this writer may take. What is left waits for the writers still in flight: the
        last one takes any group, and a request on a stream in flight can go once that writer has freed it."""
        me = asyncio.current_task()
        assert me is not None
        try:
            while True:
                group = self._inflight[me]
                try:
                    results = await self._append_group(group)
                except asyncio.CancelledError:  # shutting down: nobody is left to write the queue
                    self._fail_all(group)
                    raise
                except Exception as exc:  # noqa: BLE001 - every waiter of the group gets the failure; the loop goes on
                    for p in group:
                        if not p.done.done():
                            p.done.set_exception(exc)
                else:
                    for p, result in zip(group, results, strict=True):
                        if not p.done.done():
                            p.done.set_result(result)
                finally:
                    for p in group:
                        self._busy -= p.streams
                group = self._take_group(1 if len(self._inflight) == 1 else self.concurrent_min)
                if not group:
                    return
                self._inflight[me] = group
                self._dispatch()  # freed streams may let more than one group go
        finally:
            self._inflight.pop(me, None)

    def _fail_all(self, group: list[_Pending]) -> None:
        """``group`` and the queue: a retryable ``unavailable`` to each waiter."""
        waiting, self._queue = group + self._queue, []
        for p in waiting:
            if not p.done.done():
                p.done.set_exception(DependencyUnavailable("the event store is shutting down; retry"))

    async def _append_group(self, group: list[_Pending]) -> list[list[dict[str, Any]] | None]:
        """One statement for the group; per request its replies (one per part), or None when it needs the checked
        path (a part's version did not match, or the statement hit a unique constraint: an id already stored, a
        concurrent writer)."""
        streams: list[str] = []
        expected: list[int | None] = []
        requests: list[int] = []
        part_of: list[int] = []
        nth: list[int] = []
        ids: list[str] = []  # asyncpg encodes a uuid parameter from its text as well
        types: list[str] = []
        datas: list[str] = []
        metas: list[str] = []
        for b, p in enumerate(group, 1):
            for x in p.parts:
                streams.append(x.stream_id)
                expected.append(x.expected_version)
                requests.append(b)
                i = len(streams)
                for k, e in enumerate(x.events, 1):
                    part_of.append(i)
                    nth.append(k)
                    ids.append(e.event_id)
                    types.append(e.type)
                    d, m = stored_texts(e)
                    datas.append(d)
                    metas.append(m)
        async with self.db.pool.acquire() as conn:
            try:
                rows = await conn.fetch(_GROUP_APPEND, streams, expected, part_of, nth, ids, types, datas, metas,
                                        requests)
            except asyncpg.UniqueViolationError:
                if len(group) == 1:
                    return [None]
                failed = True  # one request's conflict must not send the others down the checked path
            else:
                failed = False
        if failed:
            return [(await self._append_group([p]))[0] for p in group]
        by_part: dict[int, list[asyncpg.Record]] = {}
        for r in rows:
            by_part.setdefault(r["i"], []).append(r)
        out: list[list[dict[str, Any]] | None] = []
        i = 0
        for p in group:
            mine = [by_part[i + k] for k in range(1, len(p.parts) + 1)]
            i += len(p.parts)
            if any(m[0]["position"] is None for m in mine):
                out.append(None)
                continue
            out.append([plan_append(x.stream_id, x.expected_version, x.events, m[0]["current"], {})
                        .result([r["position"] for r in m]) for x, m in zip(p.parts, mine, strict=True)])
        return out

    async def _append_checked(self, parts: list[AppendPart]) -> list[dict[str, Any]] | None:
        """Per part, read the stream version and which ids are stored, plan (duplicates, version check), insert —
        all in one transaction (a conflict in any part rolls back the parts before it). None when a writer raced
        it (a unique constraint failed: the next read sees that writer's events, so the caller's retry decides
        again)."""
        results: list[dict[str, Any]] = []
        async with db_errors(), self.db.pool.acquire() as conn:
            try:
                async with conn.transaction():
                    for part in parts:
                        ids = [e.event_id for e in part.events]
                        rows = await conn.fetch(_STATE, part.stream_id, ids)
                        current = rows[0]["current"]
                        existing = {str(r["event_id"]): StoredRef(r["stream_id"], r["version"], r["position"])
                                    for r in rows if r["event_id"] is not None}
                        plan = plan_append(part.stream_id, part.expected_version, part.events, current, existing)
                        results.append(plan.result(await self._insert(conn, plan)))
            except asyncpg.UniqueViolationError:
                return None
        return results

    @staticmethod
    async def _insert(conn: asyncpg.Connection, plan: AppendPlan) -> list[int]:
        if not plan.to_insert:
            return []
        texts = [stored_texts(e) for _, e in plan.to_insert]
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
            [e.event_id for _, e in plan.to_insert],
            [e.type for _, e in plan.to_insert],
            [d for d, _ in texts],
            [m for _, m in texts],
        )
        by_version = {r["version"]: r["position"] for r in rows}
        return [by_version[v] for v, _ in plan.to_insert]

    async def read_stream(self, stream_id: str, from_version: int, limit: int, max_bytes: int) -> dict[str, Any]:
        """A page of a stream from ``from_version``: whole events while their JSON fits ``max_bytes`` (at least
        one, so an event larger than the budget still moves), at most ``limit`` of them."""
        async with db_errors(), self.db.pool.acquire() as conn:
            rows = await conn.fetch(_PAGE_STREAM, stream_id, from_version, limit, max_bytes)
        last = rows[0]["last"]
        events = [row_to_event(r) for r in rows if r["position"] is not None]
        nxt = events[-1]["version"] + 1 if events else max(from_version, 1)
        return {"streamId": stream_id, "events": events, "lastVersion": last, "nextVersion": nxt,
                "more": nxt <= last}

    async def read_stream_last(self, stream_id: str) -> dict[str, Any]:
        """The stream's last event (none when the stream does not exist) and its version: one statement."""
        async with db_errors(), self.db.pool.acquire() as conn:
            row = await conn.fetchrow(_SELECT + "WHERE stream_id = $1 ORDER BY version DESC LIMIT 1", stream_id)
        last = row["version"] if row is not None else 0
        return {"streamId": stream_id, "events": [row_to_event(row)] if row is not None else [],
                "lastVersion": last, "nextVersion": last + 1, "more": False}

    async def read_all(self, after_position: int, limit: int, max_bytes: int) -> dict[str, Any]:
        """A page of the log after the event at ``after_position`` (0: the start), in commit order, cut like
        :meth:`read_stream`; ``more`` when the page was cut (by the budget or the count) before the visible head
        of the log."""
        async with db_errors(), self.db.pool.acquire() as conn:
            rows = await conn.fetch(_PAGE_ALL, after_position, limit, max_bytes)
        if not rows[0]["known"]:
            raise InvalidPayload(f"afterPosition {after_position} is not the position of an event",
                                 details={"afterPosition": after_position})
        rows = [r for r in rows if r["position"] is not None]
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
