"""Outbox relay: publishes committed events to JetStream and marks their outbox rows.

Each unpublished row (oldest position first) goes to ``<prefix>.<Type>`` on stream ``CTX_EVENTS`` with header
``Nats-Msg-Id`` = event id, then the row is marked published. The body is the stored event
(``event_store.event_json``): its ``data`` and ``metadata`` are the stored JSON text, byte for byte. A relay
killed between the JetStream ack and the mark publishes the row again on restart; JetStream drops it as a
duplicate inside the stream's duplicate window (the relay creates the stream with ``events_duplicate_window_s``).
Consumers still dedupe by ``eventId``/``position`` for anything older than the window.

A batch is pipelined (all rows sent, then the acks awaited): one JetStream round trip per batch, not per event.
One replica relays at a time: a round holds a transaction-level advisory lock (``pg_try_advisory_xact_lock``; a
replica that does not get it has nothing to do this round), so replicas never publish the same row
concurrently. The rows are read without a row lock on purpose: a row lock would give the round a transaction id
for as long as JetStream takes to store the batch, and every log reader (``read_all``, the projector) waits for
the oldest running transaction id (``event_store.VISIBLE_BELOW``); the round gets one only for its closing
UPDATE.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from typing import Any

import structlog
from ctxbuild_platform.streams import ensure_stream
from nats.aio.client import Client as NatsClient
from nats.js.api import StorageType, StreamConfig
from nats.js.client import JetStreamContext

from .db import RELAXED, Database
from .event_store import event_json
from .worker import WakeableWorker

log = structlog.get_logger("outbox")

# RELAXED (set in the claim, no extra round trip): a mark lost in a crash only republishes rows, which JetStream
# drops as duplicates.
# The claim's cost must not grow with the log. Its pending rows come first (the partial index, LIMIT), then one
# events_pkey probe per row: a LATERAL subquery with LIMIT is never flattened into a join, and as a join the
# generic plan of this prepared statement (LIMIT $1 unknown, so priced as a tenth of the pending rows) was a merge
# join that walked events_pkey from the log's first position on every round.
# CUSTOM_PLANS (transaction-local): the round's later statements are planned with their values. The cached generic
# plan of the mark, made while persistence.outbox was small, seq-scanned the whole table on every round until an
# ANALYZE invalidated it.
CUSTOM_PLANS = "(SELECT set_config('plan_cache_mode', 'force_custom_plan', true)) AS custom_plans"
_CLAIM = (
    "SELECT o.position, e.stream_id, e.version, e.event_id, e.type, e.data::text AS data, "
    "       e.metadata::text AS metadata, e.recorded_at "
    "FROM " + RELAXED + ", " + CUSTOM_PLANS + ", (SELECT pg_try_advisory_xact_lock($2) AS mine) AS relay, "
    "     LATERAL (SELECT p.position FROM persistence.outbox p WHERE relay.mine AND p.published_at IS NULL "
    "              ORDER BY p.position LIMIT $1) AS o, "
    "     LATERAL (SELECT x.stream_id, x.version, x.event_id, x.type, x.data, x.metadata, x.recorded_at "
    "              FROM persistence.events x WHERE x.position = o.position LIMIT 1) AS e "
    "ORDER BY o.position"
)
RELAY_LOCK = 0x6374785F72656C61  # 'ctx_rela': the one relaying replica
MAX_PENDING = 4000  # publishes in flight on the relay's JetStream context (nats-py's default)
TRACE_KEYS = ("traceparent", "tracestate")


def event_headers(row: Mapping[str, Any]) -> dict[str, str]:
    """The JetStream headers of a claimed row (``metadata`` as its stored JSON text)."""
    headers = {
        "Nats-Msg-Id": str(row["event_id"]),
        "content-type": "application/json",
        "Ctx-Event-Type": row["type"],
        "Ctx-Stream-Id": row["stream_id"],
        "Ctx-Event-Version": str(row["version"]),
        "Ctx-Position": str(row["position"]),
    }
    metadata = json.loads(row["metadata"])  # small (the trace context and the caller's keys), unlike data
    for k in TRACE_KEYS:  # the appender's trace continues into every consumer of the event
        v = metadata.get(k)
        if isinstance(v, str) and v and "\n" not in v and "\r" not in v:
            headers[k] = v
    return headers


class OutboxRelay(WakeableWorker):
    """Unmarked outbox rows are republished after a stop or crash; JetStream dedupes them by Nats-Msg-Id."""

    task_name = "outbox-relay"

    def __init__(self, db: Database, connection: Callable[[], NatsClient], *, stream: str, subject_prefix: str,
                 duplicate_window_s: float, poll_interval_s: float, batch_size: int, publish_timeout_s: float,
                 max_backoff_s: float, replicas: int = 1, max_age_s: float = 0.0, min_interval_s: float = 0.0) -> None:
        super().__init__(db, batch_size=batch_size, poll_interval_s=poll_interval_s, max_backoff_s=max_backoff_s,
                         min_interval_s=min_interval_s)
        self.replicas = replicas
        self.max_age_s = max_age_s
        self._connection = connection
        self.stream = stream
        self.subject_prefix = subject_prefix
        self.duplicate_window_s = duplicate_window_s
        self.publish_timeout_s = publish_timeout_s
        self._stream_ready = False
        self._js_ctx: JetStreamContext | None = None
        self._js_conn: NatsClient | None = None
        self.published_total = 0

    # ---------- work ----------
    async def ensure_stream(self) -> None:
        if await ensure_stream(self._js(), StreamConfig(name=self.stream, subjects=[f"{self.subject_prefix}.>"],
                                                        storage=StorageType.FILE,
                                                        duplicate_window=self.duplicate_window_s,
                                                        num_replicas=self.replicas,
                                                        max_age=self.max_age_s or None)):
            log.info("stream-created", stream=self.stream)
        self._stream_ready = True

    def _js(self) -> JetStreamContext:
        """One JetStream context per connection: publish_async keeps its reply subscription on it."""
        nc = self._connection()
        if self._js_ctx is None or self._js_conn is not nc:
            self._js_ctx = nc.jetstream(timeout=self.publish_timeout_s,
                                        publish_async_max_pending=max(MAX_PENDING, self.batch_size))
            self._js_conn = nc
        return self._js_ctx

    async def relay_once(self) -> int:
        """Publish one batch; returns how many rows were published (and marked).

        The batch is pipelined: every row is sent (in position order, on one connection, so JetStream stores
        them in that order), then the acks are awaited. Rows acked are marked; the first failure is recorded
        and the batch ends there — rows after it stay unmarked even if JetStream stored them, and their
        republish is dropped as a duplicate (Nats-Msg-Id)."""
        if not self._stream_ready:
            await self.ensure_stream()
        js = self._js()
        published: list[tuple[int, int]] = []
        failure: tuple[int, str] | None = None
        async with self.db.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(_CLAIM, self.batch_size, RELAY_LOCK)
            pending: list[tuple[int, asyncio.Future]] = []
            # when every row has a free in-flight slot, the wait for one cannot stall: no timer for it (on Python
            # 3.11 a timed wait is a task per message); otherwise wait at most the publish timeout
            stall = (None if js.publish_async_pending() + len(rows) <= max(MAX_PENDING, self.batch_size)
                     else self.publish_timeout_s)
            try:
                for row in rows:
                    # the body holds data and metadata as stored (never decoded and encoded again)
                    future = await js.publish_async(
                        f"{self.subject_prefix}.{row['type']}", event_json(row).encode(),
                        wait_stall=stall, stream=self.stream, headers=event_headers(row))
                    pending.append((row["position"], future))
            except Exception as exc:  # noqa: BLE001 - send failed: await what went out, keep the rest
                failure = (rows[len(pending)]["position"], f"{type(exc).__name__}: {exc}"[:500])
            for i, (position, future) in enumerate(pending):
                try:
                    # an ack already in needs no timer (nor a loop turn): pipelined acks mostly arrive together
                    ack = future.result() if future.done() else await asyncio.wait_for(
                        future, timeout=self.publish_timeout_s)
                except Exception as exc:  # noqa: BLE001 - stop at the first missing ack
                    failure = (position, f"{type(exc).__name__}: {exc}"[:500])
                    for _, rest in pending[i + 1:]:
                        rest.cancel()
                    break
                published.append((position, ack.seq))
            if published:
                await conn.execute(
                    "UPDATE persistence.outbox o SET published_at = now(), attempts = o.attempts + 1, "
                    "js_sequence = p.seq, last_error = NULL "
                    "FROM unnest($1::bigint[], $2::bigint[]) AS p(position, seq) WHERE o.position = p.position",
                    [p for p, _ in published], [s for _, s in published])
            if failure is not None:
                await conn.execute("UPDATE persistence.outbox SET attempts = attempts + 1, last_error = $2 "
                                   "WHERE position = $1", *failure)
        self.published_total += len(published)
        if failure is not None:
            raise RuntimeError(f"publish of position {failure[0]} failed: {failure[1]}")
        return len(published)

    async def round(self) -> int:
        return await self.relay_once()

    def more(self, done: int | None) -> bool:
        return (done or 0) >= self.batch_size  # a full batch: more is waiting

    async def failed(self, error: str, retry_in_s: float) -> None:
        self._stream_ready = False  # re-check the stream (it may have been deleted) next round
        log.warning("relay-failed", error=error[:300], retry_in_s=retry_in_s)
