"""Persistence against the real stack: the service process, Postgres and NATS/JetStream (no mocks)."""

from __future__ import annotations

import asyncio
import json
import uuid

import asyncpg
import httpx
import pytest
from ctxbuild_platform.errors import RemoteError

from tests.support.persistence import append, event, new_id, read_all_until, wait_until

pytestmark = pytest.mark.integration

SHA = "0f" * 32


@pytest.fixture(scope="module")
def persistence(start_service) -> str:
    return start_service("persistence")


async def test_ready(persistence):
    async with httpx.AsyncClient() as c:
        r = await c.get(f"{persistence}/readyz")
    assert r.status_code == 200, r.text


async def test_append_and_read_back(persistence, rpc):
    stream = f"test:{new_id()}"
    evs = [event("ThingHappened", {"z": 1, "a": {"y": 2, "b": 3}}, metadata={"correlationId": "corr-1"}),
           event("ThingHappened", {"n": "ü ☃ \u0000 end"})]
    res = await append(rpc, stream, evs, expected=0)
    assert res["streamId"] == stream and res["fromVersion"] == 1 and res["toVersion"] == 2
    assert res["duplicates"] == 0 and res["positions"][1] == res["positions"][0] + 1

    got = await rpc.call("ctx.persist.read_stream", {"streamId": stream})
    assert got["lastVersion"] == 2
    assert [(x["eventId"], x["version"], x["position"], x["type"]) for x in got["events"]] == [
        (evs[0]["eventId"], 1, res["positions"][0], "ThingHappened"),
        (evs[1]["eventId"], 2, res["positions"][1], "ThingHappened")]
    first = got["events"][0]
    assert first["data"] == evs[0]["data"]
    # stored bytes are kept: key order survives the round trip (json, not jsonb)
    assert json.dumps(first["data"]) == json.dumps(evs[0]["data"])
    assert got["events"][1]["data"] == evs[1]["data"]
    assert first["metadata"]["correlationId"] == "corr-1"
    assert first["metadata"]["traceparent"].startswith("00-")  # the append's trace context is recorded
    assert first["streamId"] == stream and first["recordedAt"]

    page = await rpc.call("ctx.persist.read_stream", {"streamId": stream, "fromVersion": 2, "limit": 5})
    assert [x["version"] for x in page["events"]] == [2] and page["lastVersion"] == 2
    page = await rpc.call("ctx.persist.read_stream", {"streamId": stream, "limit": 1})
    assert [x["version"] for x in page["events"]] == [1] and page["lastVersion"] == 2
    empty = await rpc.call("ctx.persist.read_stream", {"streamId": f"test:{new_id()}"})
    assert empty["events"] == [] and empty["lastVersion"] == 0


async def test_expected_version_conflict(persistence, rpc):
    stream = f"test:{new_id()}"
    await append(rpc, stream, [event("ThingHappened", {})], expected=0)
    with pytest.raises(RemoteError) as exc:
        await append(rpc, stream, [event("ThingHappened", {})], expected=0)
    assert exc.value.code == "version-conflict" and exc.value.retryable is False
    assert exc.value.details["actualVersion"] == 1
    with pytest.raises(RemoteError) as exc:
        await append(rpc, stream, [event("ThingHappened", {})], expected=5)
    assert exc.value.code == "version-conflict"
    ok = await append(rpc, stream, [event("ThingHappened", {})], expected=1)
    assert ok["fromVersion"] == 2
    got = await rpc.call("ctx.persist.read_stream", {"streamId": stream})
    assert got["lastVersion"] == 2 and len(got["events"]) == 2


async def test_same_event_id_is_stored_once(persistence, rpc):
    stream = f"test:{new_id()}"
    evs = [event("ThingHappened", {"i": 1}), event("ThingHappened", {"i": 2})]
    first = await append(rpc, stream, evs, expected=0)
    again = await append(rpc, stream, evs, expected=0)  # a retry of an acknowledged append
    assert again["duplicates"] == 2 and again["positions"] == first["positions"]
    assert (again["fromVersion"], again["toVersion"]) == (1, 2)
    # concurrent retries of the same new event: one stores it, the others see duplicates
    lone = event("ThingHappened", {"i": 3})
    results = await asyncio.gather(*(append(rpc, stream, [lone]) for _ in range(5)))
    assert sorted(r["duplicates"] for r in results) == [0, 1, 1, 1, 1]
    assert len({r["positions"][0] for r in results}) == 1
    got = await rpc.call("ctx.persist.read_stream", {"streamId": stream})
    assert [x["data"]["i"] for x in got["events"]] == [1, 2, 3] and got["lastVersion"] == 3


async def test_event_id_reused_on_another_stream_is_rejected(persistence, rpc):
    ev = event("ThingHappened", {})
    await append(rpc, f"test:{new_id()}", [ev])
    with pytest.raises(RemoteError) as exc:
        await append(rpc, f"test:{new_id()}", [ev])
    assert exc.value.code == "event-id-conflict"


async def test_concurrent_appends_are_read_once_each_from_the_global_order(persistence, rpc):
    head = (await append(rpc, f"test:{new_id()}", [event("ThingHappened", {})]))["positions"][0]
    streams = [f"test:{new_id()}" for _ in range(20)]
    done = asyncio.Event()

    async def writer(stream: str) -> dict:
        return await append(rpc, stream, [event("ThingHappened", {"k": k}) for k in range(3)], expected=0)

    # pages through the global order while appends commit: every event once, an append's events together
    results: list[dict] = []
    task = asyncio.create_task(read_all_until(rpc, head, done, limit=500,
                                              expect=lambda: {p for r in results for p in r["positions"]}))
    results += await asyncio.gather(*(writer(s) for s in streams))
    done.set()
    seen, repeats = await asyncio.wait_for(task, 60)

    assert repeats == []
    mine = sorted(p for r in results for p in r["positions"])
    assert len(set(mine)) == 60 and min(mine) > head  # 20 appends x 3 events
    for r in results:  # an append's events are consecutive in position and in the log: appends never interleave
        assert r["positions"] == list(range(r["positions"][0], r["positions"][0] + 3))
        at = seen.index(r["positions"][0])
        assert seen[at:at + 3] == r["positions"]
    assert set(mine) <= set(seen)
    for s, r in zip(streams, results, strict=True):
        got = await rpc.call("ctx.persist.read_stream", {"streamId": s})
        assert [x["position"] for x in got["events"]] == r["positions"]
        assert [x["version"] for x in got["events"]] == [1, 2, 3]


async def test_outbox_relays_to_jetstream_once(persistence, rpc, nats_broker, stack):
    from nats.js.errors import NotFoundError

    js = nats_broker._connection.jetstream()
    type_ = f"Probe{uuid.uuid4().hex[:12]}"
    subject = f"ctx.evt.{type_}"
    ev = event(type_, {"hello": "world"})
    res = await append(rpc, f"test:{new_id()}", [ev])
    position = res["positions"][0]

    async def published():
        try:
            return await js.get_last_msg("CTX_EVENTS", subject)
        except NotFoundError:
            return None

    msg = await wait_until(published)
    assert msg.headers["Nats-Msg-Id"] == ev["eventId"]
    body = json.loads(msg.data)
    assert body["eventId"] == ev["eventId"] and body["position"] == position and body["type"] == type_
    assert body["data"] == {"hello": "world"} and body["version"] == 1
    info = await js.stream_info("CTX_EVENTS")
    assert info.config.subjects == ["ctx.evt.>"]

    # a relay killed after the JetStream ack but before marking the row publishes it again: deduped
    conn = await asyncpg.connect(stack.env["CTX_DATABASE_URL"])
    try:
        async def marked():  # the relay marks the row once JetStream has acked it: just after, not with it
            r = await conn.fetchrow("SELECT published_at, attempts FROM persistence.outbox WHERE position = $1",
                                    position)
            return r if r["published_at"] is not None else None

        row = await wait_until(marked)
        assert row["attempts"] == 1
        await conn.execute("UPDATE persistence.outbox SET published_at = NULL WHERE position = $1", position)
        row = await wait_until(marked)
        assert row["attempts"] == 2
    finally:
        await conn.close()
    counts = (await js.stream_info("CTX_EVENTS", subjects_filter=subject)).state.subjects
    assert counts == {subject: 1}


async def test_history_folds_appended_events(persistence, rpc):
    cid = new_id()
    stream = f"conversation:{cid}"
    att = {"sha256": SHA, "handle": "notes.txt", "displayName": "notes.txt", "mediaType": "text/plain",
           "size": 12, "uri": f"blob://{SHA}"}
    tool_call = {"type": "tool-call", "toolCallId": "call-1", "toolName": "web_search", "input": {"q": "x"}}
    tool_result = {"type": "tool-result", "toolCallId": "call-1", "toolName": "web_search",
                   "output": {"type": "json", "value": [{"id": "ab-1", "title": "t", "url": "u", "content": "c"}]}}
    await append(rpc, stream, [
        event("ConversationCreated", {"conversationId": cid, "title": "Trip"}),
        event("UserMessageAdded", {"message": {"id": "u1", "role": "user", "parentId": None, "parts": [
            {"type": "text", "text": "read this"},
            {"type": "file", "handle": "notes.txt", "displayName": "notes.txt", "mediaType": "text/plain",
             "sha256": SHA, "size": 12}]}}),
        event("AttachmentAdded", {"attachment": att}),
    ], expected=0)
    await append(rpc, stream, [event("AssistantMessageCompleted", {"turnId": "t1", "messages": [
        {"id": "a1", "role": "assistant", "parentId": "u1", "parts": [tool_call]},
        {"id": "tr1", "role": "tool", "parentId": "a1", "parts": [tool_result]},
        {"id": "a2", "role": "assistant", "parentId": "tr1", "parts": [{"type": "text", "text": "done"}],
         "usage": {"inputTokens": 10, "outputTokens": 2}},
    ]})], expected=3)
    await append(rpc, stream, [
        event("UserMessageAdded", {"message": {"id": "u2", "role": "user", "parentId": "a2",
                                               "parts": [{"type": "text", "text": "more"}]}}),
        event("CompactionSummaryRecorded", {"boundaryId": "u2", "summary": "they asked about a trip"}),
    ], expected=4)

    h = await rpc.call("ctx.persist.history", {"conversationId": cid})
    assert h["conversationId"] == cid and h["version"] == 6 and h["title"] == "Trip"
    assert [m["id"] for m in h["messages"]] == ["u1", "a1", "tr1", "a2", "u2"]
    assert [m.get("turnId") for m in h["messages"]] == [None, "t1", "t1", "t1", None]
    assert h["messages"][2]["parts"] == [tool_result]
    assert h["messages"][-1]["compactionSummary"] == "they asked about a trip"
    assert "compactionSummary" not in h["messages"][0]
    assert h["attachments"] == [{k: att[k] for k in ("sha256", "handle", "displayName", "mediaType", "size")}]

    h = await rpc.call("ctx.persist.history", {"conversationId": cid, "anchorId": "a1"})
    assert [m["id"] for m in h["messages"]] == ["u1", "a1"]

    for payload in ({"conversationId": new_id()}, {"conversationId": cid, "anchorId": "nope"}):
        with pytest.raises(RemoteError) as exc:
            await rpc.call("ctx.persist.history", payload)
        assert exc.value.code == "not-found"


async def test_invalid_payloads_are_rejected_and_nothing_is_stored(persistence, rpc):
    stream = f"test:{new_id()}"
    bad_requests = [
        {"streamId": stream, "expectedVersion": None, "events": [{"eventId": "not-a-uuid", "type": "X", "data": {}}]},
        {"streamId": stream, "expectedVersion": None, "events": []},
        {"streamId": stream, "events": [event("ThingHappened", {})]},  # expectedVersion is required
        {"streamId": stream, "expectedVersion": None, "events": [event("bad.type", {})]},
    ]
    for payload in bad_requests:
        with pytest.raises(RemoteError) as exc:
            await rpc.call("ctx.persist.append", payload)
        assert exc.value.code == "invalid-payload", payload

    # the event's data violates contracts/events/UserMessageAdded.json (no role): the whole append is refused
    good = event("ThingHappened", {})
    bad = event("UserMessageAdded", {"message": {"id": "m", "parts": []}})
    with pytest.raises(RemoteError) as exc:
        await append(rpc, stream, [good, bad])
    assert exc.value.code == "invalid-payload" and exc.value.details["eventIndex"] == 1
    assert "UserMessageAdded" in exc.value.remote_message

    with pytest.raises(RemoteError) as exc:
        await rpc.call("ctx.persist.read_stream", {"streamId": stream, "fromVersion": 0})
    assert exc.value.code == "invalid-payload"
    got = await rpc.call("ctx.persist.read_stream", {"streamId": stream})
    assert got["events"] == [] and got["lastVersion"] == 0


async def test_killed_service_restarts_and_republishes_unmarked_rows_once(persistence, rpc, nats_broker, stack,
                                                                         start_service):
    """Runs last in this module: it kills the session's persistence process and starts a new one."""
    import signal

    from nats.js.errors import NotFoundError

    js = nats_broker._connection.jetstream()
    type_ = f"Probe{uuid.uuid4().hex[:12]}"
    subject = f"ctx.evt.{type_}"
    stream = f"test:{new_id()}"
    ev = event(type_, {"n": 1})
    position = (await append(rpc, stream, [ev], expected=0))["positions"][0]

    async def count() -> int:
        try:
            info = await js.stream_info("CTX_EVENTS", subjects_filter=subject)
        except NotFoundError:
            return 0
        return (info.state.subjects or {}).get(subject, 0)

    await wait_until(count)
    stack.stop("persistence", sig=signal.SIGKILL)
    # the crash window: JetStream acked, the outbox row was never marked
    conn = await asyncpg.connect(stack.env["CTX_DATABASE_URL"])
    try:
        await conn.execute("UPDATE persistence.outbox SET published_at = NULL WHERE position = $1", position)
        start_service("persistence")  # migrations run again: a no-op on an up-to-date schema

        async def marked():
            return await conn.fetchval("SELECT published_at IS NOT NULL FROM persistence.outbox "
                                       "WHERE position = $1", position)

        await wait_until(marked)
    finally:
        await conn.close()
    assert await count() == 1
    got = await rpc.call("ctx.persist.read_stream", {"streamId": stream})
    assert [x["eventId"] for x in got["events"]] == [ev["eventId"]]
    res = await append(rpc, stream, [event("ThingHappened", {})], expected=1)
    assert res["fromVersion"] == 2
