"""The outbox relay's round reads the rows it publishes, not the log before them: with thousands of events already
published, its claim reads one event row per claimed row under either plan Postgres may use for the prepared
statement. Under the generic plan (the one Postgres caches for a prepared statement after a few runs) the claim
used to be a merge join that walked ``events_pkey`` from the first position on every round, so the relay fell
behind sustained load once many events had been published. Counted with EXPLAIN ANALYZE's row counts, not timed."""

from __future__ import annotations

import json

import asyncpg
import pytest
from ctxbuild_persistence.adapters.outbox import _CLAIM

from tests.support.persistence import append, event, new_id, wait_until

pytestmark = pytest.mark.integration

PUBLISHED = 2000  # events published before the pending ones
BATCH = 100  # the relay's default batch
TEST_LOCK = 0x6374785F74657374  # not the relay's lock: the service's relay keeps running beside the test


@pytest.fixture(scope="module")
def persistence(start_service) -> str:
    return start_service("persistence")


def _rows_read(plan: dict, relation: str) -> float:
    """Rows the plan's scans of ``relation`` returned, over all their loops."""
    own = plan["Actual Rows"] * plan["Actual Loops"] if plan.get("Relation Name") == relation else 0
    return own + sum(_rows_read(p, relation) for p in plan.get("Plans", []))


async def test_claim_reads_only_the_rows_it_claims_however_long_the_published_log(persistence, rpc, stack):
    stream = f"test:{new_id()}"
    positions: list[int] = []
    for v in range(0, PUBLISHED, 500):
        res = await append(rpc, stream, [event("ThingHappened", {"i": v + i}) for i in range(500)], expected=v)
        positions += res["positions"]
    conn = await asyncpg.connect(stack.env["CTX_DATABASE_URL"])
    try:
        async def published() -> bool:
            return not await conn.fetchval("SELECT count(*) FROM persistence.outbox WHERE position = ANY($1) "
                                           "AND published_at IS NULL", positions)

        await wait_until(published, 60, "the relay published the log", interval=0.05)
        await conn.execute(f"PREPARE relay_claim(bigint, bigint) AS {_CLAIM}")
        tx = conn.transaction()
        await tx.start()
        try:
            # a backlog after the published log, as large as the whole log, and the statistics taken meanwhile (when
            # the relay is behind): uncommitted, so invisible to the service's relay, and rolled back with the
            # statistics
            backlog = await conn.fetchval("SELECT count(*) FROM persistence.events")
            await conn.execute(
                "WITH ins AS (INSERT INTO persistence.events (stream_id, version, event_id, type, data) "
                "SELECT $1, v, gen_random_uuid(), 'ThingHappened', '{}' FROM generate_series(1, $2) AS v "
                "RETURNING position) INSERT INTO persistence.outbox (position) SELECT position FROM ins",
                f"test:{new_id()}", backlog)
            await conn.execute("ANALYZE persistence.events, persistence.outbox")
            for mode in ("force_generic_plan", "force_custom_plan"):
                await conn.execute(f"SET LOCAL plan_cache_mode = {mode}")
                out = await conn.fetchval(
                    f"EXPLAIN (ANALYZE, TIMING OFF, FORMAT JSON) EXECUTE relay_claim({BATCH}, {TEST_LOCK})")
                plan = json.loads(out)[0]["Plan"]
                assert plan["Actual Rows"] == BATCH, mode
                assert _rows_read(plan, "events") <= BATCH, (mode, json.dumps(plan)[:3000])
                assert _rows_read(plan, "outbox") <= BATCH, (mode, json.dumps(plan)[:3000])
            # the round's later statements (the mark of the published rows) are planned with their values, not
            # with a generic plan cached while the outbox was small
            assert await conn.fetchval("SELECT current_setting('plan_cache_mode')") == "force_custom_plan"
            claimed = [r["position"] for r in await conn.fetch(f"EXECUTE relay_claim({BATCH}, {TEST_LOCK})")]
            assert len(claimed) == BATCH and claimed == sorted(claimed) and claimed[0] > max(positions)
        finally:
            await tx.rollback()
            await conn.execute("DEALLOCATE relay_claim")
    finally:
        await conn.close()
