"""The conversation projection on the real service: history read from the projection equals the fold of the
events, read-your-writes, branches, file references, the fallback when the projection is held back, a short
conversation always folded (behind the projector or not) with the projection's content while a long one waits for
the projection, two projectors racing, and the rebuild command (rebuild == live)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import asyncpg
import pytest
from ctxbuild_codec.models.subjects.ctx_persist_history_request import PersistHistoryRequest
from ctxbuild_persistence.adapters.db import Database
from ctxbuild_persistence.adapters.event_store import EventStore
from ctxbuild_persistence.adapters.projection import Projector, read_events, read_page, snapshot, stream_head
from ctxbuild_persistence.app import History
from ctxbuild_persistence.domain.conversation import history
from ctxbuild_persistence.settings import Settings
from ctxbuild_platform.errors import RemoteError, ServiceError

from tests.support.persistence import append, event, new_id, projection_history, wait_until

pytestmark = pytest.mark.integration

SHA = "0f" * 32
# the service's setting (the stack leaves it at its default): conversations up to this many events are always
# folded, the projection not read; longer ones are read from the projection, waiting for it
FOLD_MAX = Settings.model_fields["history_fold_max_events"].default


@pytest.fixture(scope="module")
def persistence(start_service) -> str:
    return start_service("persistence")


def msg(id_: str, role: str = "user", text: str | None = None, **extra) -> dict:
    return {"id": id_, "role": role, "parts": [{"type": "text", "text": text or id_}], **extra}


def filler(count: int) -> list[dict]:
    """``count`` UserMessageAdded events p0…: a conversation longer than FOLD_MAX is read from the projection."""
    return [event("UserMessageAdded", {"message": msg(f"p{i}")}) for i in range(count)]



async def folded(rpc, cid: str, anchor: str | None = None) -> dict:
    events = (await rpc.call("ctx.persist.read_stream", {"streamId": f"conversation:{cid}"}))["events"]
    return history(cid, events, anchor)


def same(projected: dict, fold: dict) -> None:
    assert projected["source"] == "projection"
    assert {**projected, "source": "-"} == {**fold, "source": "-"}


async def caught_up(db_url: str, timeout: float = 15.0) -> int:
    conn = await asyncpg.connect(db_url)
    try:
        deadline = time.monotonic() + timeout
        while True:  # the log's order is (tx, position): caught up = the tracked event is the last in that order
            pos, done = await conn.fetchrow(
                "SELECT t.position, coalesce((e.tx, e.position) >= (SELECT tx, position FROM persistence.events "
                "ORDER BY tx DESC, position DESC LIMIT 1), NOT EXISTS (SELECT 1 FROM persistence.events)) "
                "FROM persistence.projection_tracking t LEFT JOIN persistence.events e ON e.position = t.position "
                "WHERE t.name = 'conversation'")
            if done:
                return pos
            if time.monotonic() > deadline:
                raise AssertionError(f"projection stuck at {pos}")
            await asyncio.sleep(0.05)
    finally:
        await conn.close()


def run_cli(stack, *args: str) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "ctxbuild_persistence", *args], capture_output=True, text=True,
                          env={**os.environ, "CTX_DATABASE_URL": stack.env["CTX_DATABASE_URL"]}, timeout=120,
                          check=False)
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


async def build_tree(rpc, cid: str) -> None:
    """u1 → a1 (tool call) → t1 (offloaded output) → a2 ; a regenerated a2b beside a2 ; u2 under a2 with a
    summary; attachments (one repeated handle)."""
    stream = f"conversation:{cid}"
    att = {"sha256": SHA, "handle": "notes.txt", "displayName": "notes.txt", "mediaType": "text/plain", "size": 12}
    uri = "context://vfs/vfs_" + "ab" * 8 + ".txt"
    await append(rpc, stream, [
        event("ConversationCreated", {"conversationId": cid, "title": "Tree"}),
        event("UserMessageAdded", {"message": msg("u1", parentId=None, parts=[
            {"type": "text", "text": "read this ☃"},
            {"type": "file", "handle": "notes.txt", "displayName": "notes.txt", "mediaType": "text/plain",
             "sha256": SHA, "size": 12}])}),
        event("AttachmentAdded", {"attachment": att}),
    ], expected=0)
    await append(rpc, stream, [event("AssistantMessageCompleted", {"turnId": "turn-1", "messages": [
        {"id": "a1", "role": "assistant", "parentId": "u1",
         "parts": [{"type": "tool-call", "toolCallId": "k1", "toolName": "fs_read", "input": {"uri": uri}}]},
        {"id": "t1", "role": "tool", "parts": [{"type": "tool-result", "toolCallId": "k1", "toolName": "fs_read",
                                                "output": {"type": "text", "value": "head…tail"},
                                                "offload": {"mode": "offloaded", "uri": uri, "totalChars": 9000,
                                                            "totalLines": 10}}]},
        {"id": "a2", "role": "assistant", "parts": [{"type": "text", "text": "done"}],
         "usage": {"inputTokens": 120, "outputTokens": 7}},
    ]})], expected=3)
    await append(rpc, stream, [event("AssistantMessageCompleted", {"turnId": "turn-2", "messages": [
        {"id": "a2b", "role": "assistant", "parentId": "t1", "parts": [{"type": "text", "text": "again"}],
         "usage": {"inputTokens": 130, "outputTokens": 9}}]})], expected=4)
    await append(rpc, stream, [
        event("UserMessageAdded", {"message": msg("u2", parentId="a2")}),
        event("CompactionSummaryRecorded", {"boundaryId": "u2", "summary": "they read notes"}),
        event("AttachmentAdded", {"attachment": {**att, "size": 99}}),  # same handle: the first one wins
    ], expected=5)


async def test_history_from_the_projection_equals_the_fold(persistence, rpc, stack):
    cid = new_id()
    await build_tree(rpc, cid)
    await caught_up(stack.env["CTX_DATABASE_URL"])
    h = await projection_history(stack, cid, includeBranches=True)  # the service folds a conversation this short
    assert [m["id"] for m in h["messages"]] == ["u1", "a1", "t1", "a2", "u2"]
    assert h["branches"] == {"a2": ["a2", "a2b"]}
    assert h["lastUsage"] == {"messageId": "a2", "usage": {"inputTokens": 120, "outputTokens": 7}}
    assert h["summaries"] == [{"boundaryId": "u2", "index": 4}]
    assert h["persistedUris"] == ["context://vfs/vfs_" + "ab" * 8 + ".txt"]
    assert h["attachments"][0]["size"] == 12 and h["version"] == 8 and h["title"] == "Tree"
    fold = await folded(rpc, cid)
    same({k: v for k, v in h.items() if k != "branches"}, fold)
    # the stored bytes survive: key order of the message as appended, resolved parentId appended after
    assert list(h["messages"][3]) == ["id", "role", "parts", "usage", "parentId", "turnId"]

    for anchor in ("a2b", "t1", "u1"):
        same(await projection_history(stack, cid, anchorId=anchor), await folded(rpc, cid, anchor))
    b = await projection_history(stack, cid, anchorId="a2b", includeBranches=True)
    assert [m["id"] for m in b["messages"]] == ["u1", "a1", "t1", "a2b"] and b["branches"] == {"a2b": ["a2", "a2b"]}
    assert b["lastUsage"]["messageId"] == "a2b" and b["summaries"] == []

    conn = await asyncpg.connect(stack.env["CTX_DATABASE_URL"])
    try:
        refs = await conn.fetch("SELECT message_id, kind, ref, sha256, tool_call_id FROM persistence.file_references "
                                "WHERE conversation_id = $1 ORDER BY position, message_id", cid)
        assert [tuple(r) for r in refs] == [
            ("u1", "attachment", "notes.txt", SHA, None),
            ("t1", "tool_output", "context://vfs/vfs_" + "ab" * 8 + ".txt", None, "k1")]
        siblings = await conn.fetch("SELECT message_id FROM persistence.messages WHERE conversation_id = $1 "
                                    "AND parent_id = 't1' ORDER BY seq", cid)
        assert [r[0] for r in siblings] == ["a2", "a2b"]
    finally:
        await conn.close()

    for payload in ({"conversationId": new_id()}, {"conversationId": cid, "anchorId": "nope"}):
        with pytest.raises(RemoteError) as exc:
            await rpc.call("ctx.persist.history", payload)
        assert exc.value.code == "not-found"
    with pytest.raises(ServiceError) as exc:  # the projection's own not-found
        await projection_history(stack, cid, anchorId="nope")
    assert exc.value.code == "not-found"


async def test_read_your_writes(persistence, rpc):
    """Every history right after an append already contains it — from the projection, not by folding (the
    conversation is longer than FOLD_MAX: it waits for the projection)."""
    cid = new_id()
    stream = f"conversation:{cid}"
    await append(rpc, stream, [event("ConversationCreated", {"conversationId": cid}), *filler(FOLD_MAX)],
                 expected=0)
    version = FOLD_MAX + 1
    for i in range(25):
        res = await append(rpc, stream, [event("UserMessageAdded", {"message": msg(f"m{i}")})], expected=version)
        version = res["toVersion"]
        # turn streams append in between: the projector must pass them too
        await append(rpc, f"turn:{new_id()}", [event("TurnStarted", {"turnId": "t", "conversationId": cid,
                                                                     "userMessageId": f"m{i}"})], expected=0)
        h = await rpc.call("ctx.persist.history", {"conversationId": cid})
        assert h["source"] == "projection" and h["version"] == version
        assert h["messages"][-1]["id"] == f"m{i}" and len(h["messages"]) == FOLD_MAX + i + 1


async def test_a_projection_held_back_falls_back_to_folding(persistence, rpc, stack):
    """With the tracking row locked (a rebuild in progress, a stuck replica), history of a long conversation
    waits the bounded time and then folds the events: late, never stale."""
    cid = new_id()
    stream = f"conversation:{cid}"
    await append(rpc, stream, filler(FOLD_MAX), expected=0)
    await caught_up(stack.env["CTX_DATABASE_URL"])
    expected = [f"p{i}" for i in range(FOLD_MAX)] + ["u2"]
    conn = await asyncpg.connect(stack.env["CTX_DATABASE_URL"])
    try:
        tx = conn.transaction()
        await tx.start()
        await conn.execute("SELECT 1 FROM persistence.projection_tracking WHERE name = 'conversation' FOR UPDATE")
        await append(rpc, stream, [event("UserMessageAdded", {"message": msg("u2")})], expected=FOLD_MAX)
        h = await rpc.call("ctx.persist.history", {"conversationId": cid})  # it returns: no timeout error
        assert h["source"] == "fold" and [m["id"] for m in h["messages"]] == expected
        # the projection really was behind (its tracking row still locked): the fold answered, not stale rows
        tracked = await conn.fetchval("SELECT position FROM persistence.projection_tracking "
                                      "WHERE name = 'conversation'")
        head = await conn.fetchval("SELECT max(position) FROM persistence.events WHERE stream_id = $1", stream)
        assert tracked < head
        await tx.rollback()
    finally:
        await conn.close()
    h = await rpc.call("ctx.persist.history", {"conversationId": cid})
    assert h["source"] == "projection" and [m["id"] for m in h["messages"]] == expected


# every kind of page a reply can be: branches, anchors, the turn-start window (summary, clear), the byte budget,
# maxMessages
SHORT_READS = [{}, {"includeBranches": True}, {"anchorId": "a2b", "includeBranches": True}, {"anchorId": "t1"},
               {"anchorId": "u2", "window": "turn-start"}, {"window": "turn-start"}, {"maxBytes": 1024},
               {"anchorId": "u2", "maxMessages": 2}]


async def test_a_short_conversation_is_folded_behind_the_projector_or_not_with_the_projections_content(
        persistence, rpc, stack):
    """Up to FOLD_MAX events, history is folded: at once while the projection lacks the conversation's last event
    (no wait for the projector), and still once the projection has it (the projection is not read) — the very reply
    the projection gives, for every kind of page."""
    url = stack.env["CTX_DATABASE_URL"]
    cid = new_id()
    await caught_up(url)
    conn = await asyncpg.connect(url)
    try:
        tx = conn.transaction()
        await tx.start()  # the projector cannot move while this holds its tracking row
        await conn.execute("SELECT 1 FROM persistence.projection_tracking WHERE name = 'conversation' FOR UPDATE")
        await build_tree(rpc, cid)
        await append(rpc, f"conversation:{cid}", [event("UserMessageAdded", {"message": msg(
            "u3", text="x" * 1500, clearContext=True)})], expected=8)
        folds = [await rpc.call("ctx.persist.history", {"conversationId": cid, **r}) for r in SHORT_READS]
        tracked = await conn.fetchval("SELECT position FROM persistence.projection_tracking "
                                      "WHERE name = 'conversation'")
        head = await conn.fetchval("SELECT max(position) FROM persistence.events WHERE stream_id = $1",
                                   f"conversation:{cid}")
        assert tracked < head  # the projection really lacked the conversation while the folds answered
        await tx.rollback()
    finally:
        await conn.close()
    assert [f["source"] for f in folds] == ["fold"] * len(SHORT_READS)
    assert folds[0]["version"] == 9 and folds[1]["branches"] == {"a2": ["a2", "a2b"]}
    assert [(f["start"], f.get("clearedBefore")) for f in folds[4:7]] == [
        ("summary", False), ("clear", None), ("page", None)]
    await caught_up(url)
    for read, fold in zip(SHORT_READS, folds, strict=True):
        again = await rpc.call("ctx.persist.history", {"conversationId": cid, **read})
        assert again == fold, read  # the projection has it now, and the service still folds
        projected = await projection_history(stack, cid, **read)
        assert projected["source"] == "projection", read
        assert {**projected, "source": "-"} == {**fold, "source": "-"}, read


async def test_behind_the_projector_a_short_conversation_is_folded_at_once_a_long_one_waits(
        persistence, rpc, stack):
    """While the projection lacks a conversation's last event, a history read of a short one (≤ FOLD_MAX events)
    is folded without waiting for the projector; past FOLD_MAX it waits for the projector, then serves the
    projection. Once the projection has the short one too, it is still folded. History runs in this process on the
    stack's database, with a projector of its own that only this test moves (its waiting readers are visible)."""
    url = stack.env["CTX_DATABASE_URL"]
    db = Database(url, min_size=1, max_size=4)
    await db.connect()
    projector = Projector(db)  # never started: it moves when this test calls project_once
    settings = Settings(database_url=url, nats_url=stack.env["CTX_NATS_URL"], history_projection_wait_s=300)
    reader = History(EventStore(db), settings, projector)
    long_cid, short_cid = new_id(), new_id()
    reads: list[asyncio.Task] = []

    async def read(cid: str) -> asyncio.Task:
        """The read started, once it waits for the projector or has answered."""
        task = asyncio.create_task(reader.read(PersistHistoryRequest(conversationId=cid)))
        reads.append(task)

        async def waiting_or_answered() -> bool:
            return projector.readers_waiting > 0 or task.done()

        await wait_until(waiting_or_answered, 30, "the read waits or answers", interval=0.01)
        return task

    try:
        await append(rpc, f"conversation:{long_cid}", filler(FOLD_MAX), expected=0)
        await caught_up(url)
        await projector.project_once()  # it knows where the projection is
        conn = await asyncpg.connect(url)
        try:
            tx = conn.transaction()
            await tx.start()  # the projection cannot move while this holds its tracking row
            await conn.execute("SELECT 1 FROM persistence.projection_tracking WHERE name = 'conversation' "
                               "FOR UPDATE")
            await append(rpc, f"conversation:{short_cid}", filler(2), expected=0)
            await append(rpc, f"conversation:{long_cid}", [event("UserMessageAdded", {"message": msg("u-last")})],
                         expected=FOLD_MAX)
            short = await read(short_cid)
            assert short.done() and projector.readers_waiting == 0  # folded, not waiting
            assert short.result().source == "fold" and [m["id"] for m in short.result().messages] == ["p0", "p1"]
            long = await read(long_cid)
            assert not long.done() and projector.readers_waiting == 1  # waiting, not folded
            await tx.rollback()
        finally:
            await conn.close()
        while not long.done():
            await projector.project_once()  # projects, or learns that the service's projector did
            await asyncio.sleep(0.01)
        reply = long.result()
        assert reply.source == "projection" and reply.version == FOLD_MAX + 1
        assert [m["id"] for m in reply.messages] == [f"p{i}" for i in range(FOLD_MAX)] + ["u-last"]
        head = await stream_head(db, f"conversation:{short_cid}")
        assert max(projector.cursor, head.projected) >= head.cursor  # appended before u-last: projected too
        again = await read(short_cid)
        assert again.done() and projector.readers_waiting == 0
        assert again.result().source == "fold" and again.result().messages == short.result().messages
    finally:
        for task in reads:
            task.cancel()
        await db.close()


async def test_two_projectors_racing_apply_every_event_once(persistence, rpc, stack):
    """A second projector (another replica) runs against the same database while appends stream in: the
    tracking row serialises them, and the rows equal a rebuild from the events."""
    url = stack.env["CTX_DATABASE_URL"]
    db = Database(url, min_size=1, max_size=4)
    await db.connect()
    other = Projector(db, batch_size=7, batch_bytes=300, poll_interval_s=0.01)  # small batches, cut by bytes too
    await other.start()
    try:
        cids = [new_id() for _ in range(6)]

        async def writer(cid: str, start: int, count: int) -> None:
            stream = f"conversation:{cid}"
            for i in range(start, start + count):
                await append(rpc, stream, [event("UserMessageAdded", {"message": msg(f"m{i}")})], expected=i)

        # The service's projector is woken by each append and may take every batch of a round; keep
        # appending (bounded) until the racing replica has applied some, so the race is really exercised.
        written = 0
        for _ in range(20):
            await asyncio.gather(*(writer(c, written, 15) for c in cids))
            written += 15
            await caught_up(url)
            if other.events_applied > 0:
                break
        assert other.events_applied > 0  # it really took part
        async with db.pool.acquire() as conn:
            # the event just before the stream's first one in the log
            first = await conn.fetchval(
                "SELECT coalesce((SELECT position FROM persistence.events WHERE (tx, position) < "
                "(SELECT tx, position FROM persistence.events WHERE stream_id = $1 AND version = 1) "
                "ORDER BY tx DESC, position DESC LIMIT 1), 0)", f"conversation:{cids[0]}")
            capped = await read_events(conn, first, 100, max_bytes=1)
            assert len(capped) == 1 and capped[0].data is not None  # one event at least, then the byte cap
            assert len(await read_events(conn, first, 100, max_bytes=10_000)) > 1
            # a page says whether more may follow it: full by count or by bytes; one that is not holds the rest
            assert (await read_page(conn, first, 100, max_bytes=1))[1] is True
            assert (await read_page(conn, first, 2))[1] is True
            rest, full = await read_page(conn, first, 1_000_000, max_bytes=1 << 40)
            assert not full and len(rest) >= written * len(cids)
            assert (await read_page(conn, rest[-1].position, 10))[0] == []
        for cid in cids:
            h = await projection_history(stack, cid)  # the service folds a conversation of 15 events
            same(h, await folded(rpc, cid))
            assert len(h["messages"]) == written
    finally:
        await other.stop()
        await db.close()
    code, report = run_cli(stack, "rebuild-projections", "--verify")
    assert code == 0 and report["identical"] and report["rolledBack"], report


async def test_rebuild_gives_the_same_rows_as_the_live_projection(persistence, rpc, stack):
    url = stack.env["CTX_DATABASE_URL"]
    code, report = run_cli(stack, "migrate")  # the service applied them at start-up: nothing left to do
    assert code == 0 and report == {"applied": []}
    for _ in range(3):
        await build_tree(rpc, new_id())
    position = await caught_up(url)
    conn = await asyncpg.connect(url)
    try:
        live = await snapshot(conn)
        assert live["messages"] and live["file_references"] and live["compaction_summaries"]

        code, report = run_cli(stack, "rebuild-projections", "--verify")
        assert code == 0 and report["identical"] and report["differences"] == {}, report
        assert await snapshot(conn) == live  # a dry run changes nothing

        code, report = run_cli(stack, "rebuild-projections")
        assert code == 0 and report["identical"] and report["position"] >= position, report
        rebuilt = await snapshot(conn)
        assert rebuilt == live
        assert report["rows"]["messages"] == len(live["messages"])

        # a damaged projection: --verify reports it (exit 1), a rebuild repairs it
        await conn.execute("DELETE FROM persistence.file_references WHERE ctid IN "
                           "(SELECT ctid FROM persistence.file_references LIMIT 1)")
        await conn.execute("UPDATE persistence.messages SET body = '{\"id\":\"x\",\"role\":\"user\",\"parts\":[]}' "
                           "WHERE ctid IN (SELECT ctid FROM persistence.messages LIMIT 1)")
        code, report = run_cli(stack, "rebuild-projections", "--verify")
        assert code == 1 and report["differences"] == {"messages": {"missing": 1, "extra": 1},
                                                       "file_references": {"missing": 0, "extra": 1}}, report
        code, report = run_cli(stack, "rebuild-projections")
        assert code == 0 and not report["identical"]
        assert await snapshot(conn) == live
    finally:
        await conn.close()


async def test_an_event_that_fails_its_batch_in_the_database_is_parked_and_the_batch_goes_on(persistence, rpc,
                                                                                              stack, pg):
    """A batch is applied as one; an event that makes the database refuse it (here a message id too large for
    its index: no check before writing sees it) sends the round back to per-event savepoints, which park it and
    apply the rest of the same batch."""
    bad_cid, good_cid = new_id(), new_id()
    huge_id = os.urandom(6000).hex()  # incompressible: past a btree entry's limit
    async with pg.transaction():  # one transaction: both events in the projector's same batch
        positions = []
        for cid, mid in ((bad_cid, huge_id), (good_cid, "m-after")):
            data = json.dumps({"message": msg(mid)})
            positions.append(await pg.fetchval(
                "INSERT INTO persistence.events (stream_id, version, event_id, type, data) "
                "VALUES ($1, 1, gen_random_uuid(), 'UserMessageAdded', $2::json) RETURNING position",
                f"conversation:{cid}", data))
            await pg.execute("INSERT INTO persistence.outbox (position) VALUES ($1)", positions[-1])

    async def parked() -> asyncpg.Record | None:
        return await pg.fetchrow("SELECT stream_id, reason FROM persistence.parked_events WHERE position = $1",
                                 positions[0])

    row = await wait_until(parked, timeout=30, what="the bad event parked")
    assert row["stream_id"] == f"conversation:{bad_cid}" and "index row" in row["reason"], row["reason"]
    assert await pg.fetchval("SELECT count(*) FROM persistence.messages WHERE conversation_id = $1",
                             good_cid) == 1
    assert await pg.fetchval("SELECT last_error FROM persistence.projection_tracking "
                             "WHERE name = 'conversation'") is None
