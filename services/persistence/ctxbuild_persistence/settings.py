"""Persistence service settings (env prefix CTX_)."""

from __future__ import annotations

from ctxbuild_platform.settings import ServiceSettings
from pydantic import Field, SecretStr

from .adapters.event_store import APPEND_WRITERS


class Settings(ServiceSettings):
    service_name: str = "persistence"
    database_url: SecretStr = Field(
        description="PostgreSQL URL (postgresql://user:pw@host:port/db); no default, it may carry a password")
    db_pool_min_size: int = Field(1, ge=0)
    db_pool_max_size: int = Field(10, ge=1)
    db_connect_timeout_s: float = Field(60.0, description="start-up: how long to wait for Postgres")
    migrate_on_start: bool = Field(True, description="apply yoyo migrations at start-up")
    append_writers: int = Field(
        APPEND_WRITERS, ge=1, le=64, description="event store: groups of appends written at once, each one "
        "statement and one commit on a pooled connection of its own (their commits overlap; requests sharing a "
        "stream never go in concurrent groups; a group goes beside another only with 8 requests or more). 1 where "
        "Postgres shares the service's cores (more did not raise events/s there and cost CPU per event, "
        "docs/scaling.md); more where commits wait on a slow WAL flush. Keep it below db_pool_max_size: reads, "
        "the relay and the projector take connections too")

    events_stream: str = Field("CTX_EVENTS", description="JetStream stream the outbox relay publishes to")
    events_subject_prefix: str = Field("ctx.evt", description="events go to <prefix>.<Type>")
    events_duplicate_window_s: float = Field(
        600.0, gt=0, description="JetStream dedup window (Nats-Msg-Id) when the relay creates the stream")
    events_stream_replicas: int = Field(1, ge=1, le=5, description="replicas of the events stream when the relay "
                                        "creates it (3 on a three-node JetStream cluster)")
    events_max_age_s: float = Field(
        7 * 86_400.0, ge=0, description="age limit of the events stream when the relay creates it (0 = none); "
                                         "the event log of record is Postgres (consumers catch up with read_all)")
    enqueue_subject_prefix: str = Field(
        "ctx.turn.run", description="ctx.persist.append_batch publishes a request's `enqueue` message (after the "
        "commit) only to a subject starting with this (the turn work queue's); any other is refused. Empty: none")
    enqueue_timeout_s: float = Field(
        1.0, gt=0, description="how long the enqueue publish waits for JetStream's ack; past it the reply says "
                               "not enqueued (the commit stands) and the caller publishes itself")
    relay_poll_interval_s: float = Field(0.5, gt=0, description="outbox poll interval when idle")
    relay_min_interval_s: float = Field(
        0.05, ge=0, description="appends wake the relay at most once per this interval (a burst of appends is "
                                "published in one round; an append after a quiet spell at once)")
    relay_batch_size: int = Field(100, ge=1, le=10_000)
    relay_publish_timeout_s: float = Field(5.0, gt=0)
    relay_max_backoff_s: float = Field(5.0, gt=0, description="ceiling of the retry backoff after a failure")

    projector_batch_size: int = Field(500, ge=1, le=10_000, description="events per projection transaction")
    projector_batch_bytes: int = Field(16 * 1024 * 1024, ge=1, description="and at most this much event data")
    projector_poll_interval_s: float = Field(1.0, gt=0, description="projection poll interval when idle")
    projector_min_interval_s: float = Field(
        0.25, ge=0, description="appends wake the projector at most once per this interval (a history read that "
                                 "waits for the projection wakes it at once)")
    history_from_projection: bool = Field(
        True, description="serve ctx.persist.history from the projection (false: always fold the events)")
    history_projection_wait_s: float = Field(
        2.0, ge=0, description="read-your-writes: how long history waits for the projection to reach the "
                               "conversation's last event before folding the events instead")
    history_fold_max_events: int = Field(
        32, ge=0, description="history of a conversation whose stream has at most this many events is always "
                              "folded from the events, the projection not read, whether it has the last event or not "
                              "(0: never; longer ones read the projection, waiting for it). A fold reads the whole "
                              "stream in one statement and grows with its bytes; the projection's read is a "
                              "transaction of several statements, and waiting for it adds a projector round (its "
                              "commit included). Measured right after an append: the fold is the cheaper answer up "
                              "to about twice this length with events of 25 KB on average, and further with the "
                              "usual few-KB events")
    history_max_wait_lag: int = Field(
        10_000, ge=0, description="read-your-writes: a projection further behind than this many positions (a "
                                  "catch-up after a deploy or a rebuild) is not waited for: history folds at once")

    lane_blob_timeout_s: float = Field(30.0, gt=0, description="persist lane: timeout of one ctx.blob.put")
    lane_blob_concurrency: int = Field(8, ge=1, description="persist lane: blob writes in flight per request")
    lane_promote_inflight_refs: bool = Field(
        True, description="persist lane: give in-flight offloaded outputs a tool_output reference (ctx.blob.ref)")

    max_event_bytes: int = Field(
        64 * 1024, ge=1024, description="data+metadata JSON of one event (events stay small: large content "
                                        "travels by content reference, SPEC §15.1)")
    read_default_limit: int = Field(1000, ge=1)
    read_max_limit: int = Field(10_000, ge=1)
    read_default_bytes: int = Field(256 * 1024, ge=1024, description="page budget of read_stream, read_all and "
                                    "history when the request names none (JSON of the events/messages)")
    read_max_bytes: int = Field(768 * 1024, ge=1024, description="the largest page budget a request may ask for "
                                "(a page still holds one whole event or message when that one is larger)")
    ref_resolve_concurrency: int = Field(8, ge=1, description="history: content references read at once")
