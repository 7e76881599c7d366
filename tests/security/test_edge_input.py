"""Attacks on the HTTP edge (issue #15, SPEC §15.3) against the six services as real processes: bad text (NUL
characters, lone surrogates), oversized fields and bodies, malformed path ids in every route → a 4xx in the API's
error shape and nothing stored; five concurrent turns on one conversation → one 202 and four 409s; and an event
the projection cannot apply (written behind the service's back, as an older writer did) → parked, while every
other conversation's history is still served from the projection."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio
from ctxbuild_platform.errors import RemoteError
from security_support import start_all, stream_version

from tests.support.auth import AUTH
from tests.support.persistence import append, event, projection_history

pytestmark = [pytest.mark.security, pytest.mark.e2e]

MiB = 1024 * 1024
TURN_TEXT_LIMIT = 8 * MiB  # the orchestration defaults (Settings.max_*)
BODY_LIMIT = 64 * MiB
TITLE_LIMIT = 1000
REPLAY = {"kind": "replay", "script": [{"text": "ok"}]}
# a turn that runs for a while: 19 tool steps, each a round trip through the blob store and truncation
LONG_SCRIPT = [{"toolCalls": [{"toolName": "fs_read", "input": {"uri": "context://vfs/none.txt"}}]}] * 19 + [
    {"text": "done"}]
TERMINAL = ("TurnCompleted", "TurnFailed")


@pytest.fixture(scope="module")
def base(stack, start_service) -> str:
    return start_all(stack, start_service)


@pytest_asyncio.fixture(loop_scope="session")
async def http(base) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=base, headers=AUTH, timeout=httpx.Timeout(120, read=180)) as client:
        yield client


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def conv(base) -> str:
    """A real conversation with one finished turn: the valid ids the malformed-id cases are mixed with."""
    async with httpx.AsyncClient(base_url=base, headers=AUTH, timeout=60) as http:
        cid = (await http.post("/v1/conversations", json={"title": "ids"})).json()["id"]
        r = await http.post(f"/v1/conversations/{cid}/turns", json={"text": "hi", "provider": REPLAY})
        assert r.status_code == 202, r.text
        await wait_terminal(http, cid, r.json()["turnId"])
    return cid


def raw_json(value: object) -> bytes:
    """JSON as a client may send it: lone surrogates and NUL as \\u escapes (httpx's json= cannot encode them)."""
    return json.dumps(value).encode()


async def post_raw(http: httpx.AsyncClient, path: str, value: object) -> httpx.Response:
    return await http.post(path, content=raw_json(value), headers={"content-type": "application/json"})


def refused(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    body = r.json()
    assert body["code"] == code and body["message"] and body["retryable"] is False, body
    return body


async def wait_terminal(http: httpx.AsyncClient, cid: str, tid: str) -> dict:
    """Follow the turn's SSE stream to its terminal event (the stream ends there)."""
    async with http.stream("GET", f"/v1/conversations/{cid}/turns/{tid}/events", params={"deltas": "false"}) as r:
        event = None
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and event in TERMINAL:
                return {"type": event, "data": json.loads(line.removeprefix("data: "))}
    raise AssertionError(f"turn {tid}: the event stream ended without a terminal event")


async def events_holding(pg, marker: str) -> int:
    return await pg.fetchval("SELECT count(*) FROM persistence.events WHERE strpos(data::text, $1) > 0", marker)


# ------------------------------------------------------------------------------------------------ bad text

BAD_TEXT = {"nul": "\x00", "lone-high-surrogate": "\ud800", "lone-low-surrogate": "\udfff"}


@pytest.mark.parametrize("bad", BAD_TEXT.values(), ids=BAD_TEXT.keys())
async def test_bad_text_in_a_title_is_refused(http, pg, bad):
    marker = f"title-{uuid.uuid4().hex}"
    body = refused(await post_raw(http, "/v1/conversations", {"title": f"{marker}{bad}end"}), 422, "invalid-payload")
    assert "title" in body["message"] and ("NUL" in body["message"] or "surrogate" in body["message"])
    assert await events_holding(pg, marker) == 0


@pytest.mark.parametrize("bad", BAD_TEXT.values(), ids=BAD_TEXT.keys())
async def test_bad_text_in_a_turn_text_is_refused(http, conv, pg, bad):
    marker = f"text-{uuid.uuid4().hex}"
    before = await stream_version(pg, f"conversation:{conv}")
    body = refused(await post_raw(http, f"/v1/conversations/{conv}/turns",
                                  {"text": f"{marker}{bad}", "provider": REPLAY}),
                   422, "invalid-payload")
    assert "body.text" in body["message"]
    assert await events_holding(pg, marker) == 0
    assert await stream_version(pg, f"conversation:{conv}") == before


NESTED = {
    "settings-mcp-server": ("/v1/conversations", lambda m: {"settings": {"mcpServers": [f"{m}\x00"]}}),
    "replay-script-value": ("turns", lambda m: {"text": "x", "provider": {
        "kind": "replay", "script": [{"text": f"{m}\x00"}]}}),
    "replay-script-key": ("turns", lambda m: {"text": "x", "provider": {
        "kind": "replay", "script": [{"text": m, "meta": {"k\ud83d": 1}}]}}),
    "recorded-tool-description": ("turns", lambda m: {"text": "x", "provider": {
        "kind": "replay", "script": [{"text": m}], "tools": [{"name": "t", "description": "\udc80"}]}}),
    "abort-reason": ("abort", lambda m: {"reason": f"{m}\x00"}),
    "regenerate-script": ("regenerate", lambda m: {"provider": {"kind": "replay", "script": [{"text": f"{m}\x00"}]}}),
}


@pytest.mark.parametrize("case", NESTED.values(), ids=NESTED.keys())
async def test_bad_text_anywhere_in_a_body_is_refused(http, conv, pg, case):
    route, make = case
    marker = f"nested-{uuid.uuid4().hex}"
    tid = (await pg.fetchval("SELECT data->>'turnId' FROM persistence.events WHERE stream_id = $1 "
                             "ORDER BY version LIMIT 1", f"conversation-turns:{conv}"))
    path = {"turns": f"/v1/conversations/{conv}/turns", "abort": f"/v1/conversations/{conv}/turns/{tid}/abort",
            "regenerate": f"/v1/conversations/{conv}/turns/{tid}/regenerate"}.get(route, route)
    before = await stream_version(pg, f"conversation-turns:{conv}")
    body = refused(await post_raw(http, path, make(marker)), 422, "invalid-payload")
    assert "NUL" in body["message"] or "surrogate" in body["message"], body
    assert await events_holding(pg, marker) == 0
    assert await stream_version(pg, f"conversation-turns:{conv}") == before  # no turn admitted


async def test_a_nul_in_an_attachment_name_is_refused(http, conv, pg):
    before = await stream_version(pg, f"conversation:{conv}")
    # built by hand: httpx would percent-encode the NUL in the file name
    body = (b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="a\x00b.txt"\r\n'
            b"Content-Type: text/plain\r\n\r\nhello\r\n--XyZ--\r\n")
    r = await http.post(f"/v1/conversations/{conv}/attachments", content=body,
                        headers={"content-type": "multipart/form-data; boundary=XyZ"})
    refused(r, 422, "invalid-payload")
    assert await stream_version(pg, f"conversation:{conv}") == before


# ------------------------------------------------------------------------------------------------ sizes

async def test_a_title_one_over_the_limit_is_refused_and_one_at_it_accepted(http, pg):
    marker = uuid.uuid4().hex
    over = marker + "t" * (TITLE_LIMIT + 1 - len(marker))
    body = refused(await http.post("/v1/conversations", json={"title": over}, timeout=30), 413, "too-large")
    assert "1,000" in body["message"] and "MAX_TITLE_CHARS" in body["message"]
    assert await events_holding(pg, marker) == 0
    ok = await http.post("/v1/conversations", json={"title": over[:TITLE_LIMIT]}, timeout=30)
    assert ok.status_code == 201, ok.text


async def test_a_two_megabyte_title_is_refused_and_the_connection_stays_usable(http, pg):
    marker = uuid.uuid4().hex
    refused(await http.post("/v1/conversations", json={"title": marker + "t" * (2 * MiB)}), 413, "too-large")
    # the same keep-alive connection serves the next request (it used to be reset)
    assert (await http.post("/v1/conversations", json={"title": "next"})).status_code == 201
    assert await events_holding(pg, marker) == 0


@pytest.mark.parametrize("size", [TURN_TEXT_LIMIT + 1, 50 * 1000 * 1000], ids=["limit-plus-one", "50MB"])
async def test_an_oversized_turn_text_is_refused(http, conv, pg, size):
    marker = uuid.uuid4().hex
    before = await stream_version(pg, f"conversation:{conv}")
    text = marker + "x" * (size - len(marker))
    body = refused(await http.post(f"/v1/conversations/{conv}/turns", timeout=120,
                              json={"text": text, "provider": REPLAY}), 413, "too-large")
    assert "MAX_TURN_TEXT_BYTES" in body["message"]
    assert await stream_version(pg, f"conversation:{conv}") == before


async def test_a_turn_text_at_the_limit_is_stored_by_reference_and_read_back(http, pg):
    cid = (await http.post("/v1/conversations", json={"title": "big text"}, timeout=30)).json()["id"]
    line = "0123456789 abcdefghij ünïcödé ☃\n"
    text = (line * (TURN_TEXT_LIMIT // len(line.encode()) + 1)).encode()[:TURN_TEXT_LIMIT].decode("utf-8", "ignore")
    r = await http.post(f"/v1/conversations/{cid}/turns", timeout=120, json={"text": text, "provider": REPLAY})
    assert r.status_code == 202, r.text[:500]
    await wait_terminal(http, cid, r.json()["turnId"])
    stored = json.loads(await pg.fetchval(
        "SELECT data::text FROM persistence.events WHERE stream_id = $1 AND type = 'UserMessageAdded'",
        f"conversation:{cid}"))
    assert "contentRef" in stored["message"]["parts"]  # the event stays small
    msgs = (await http.get(f"/v1/conversations/{cid}/messages", timeout=120)).json()["messages"]
    assert msgs[0]["role"] == "user" and msgs[0]["parts"][0]["text"] == text


def auth_lines() -> bytes:
    """The session key as raw header lines (the edge authenticates before it reads a body)."""
    return "".join(f"{k}: {v}\r\n" for k, v in AUTH.items()).encode()


async def read_reply(reader: asyncio.StreamReader) -> tuple[bytes, dict]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
    length = int(next(h for h in head.decode().split("\r\n") if h.lower().startswith("content-length"))
                 .split(":")[1])
    return head, json.loads(await reader.readexactly(length))


async def test_a_body_over_the_limit_is_refused_while_it_is_read(base, pg):
    """No Content-Length (chunked): the edge counts while reading and answers 413 once past the limit; the
    client stops sending when the answer arrives."""
    marker = uuid.uuid4().hex
    reader, writer = await asyncio.open_connection(*base.removeprefix("http://").split(":"))

    async def upload() -> None:
        writer.write(b"POST /v1/conversations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n" + auth_lines() + b"\r\n")
        first = b'{"title": "' + marker.encode()
        writer.write(b"%x\r\n%s\r\n" % (len(first), first))
        chunk = b"x" * MiB
        try:
            for _ in range(BODY_LIMIT // MiB + 8):
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await writer.drain()
        except (ConnectionError, OSError):
            pass  # the server closed its side after answering: expected

    sending = asyncio.create_task(upload())
    try:
        head, payload = await read_reply(reader)
        assert head.startswith(b"HTTP/1.1 413"), head
        assert payload["code"] == "too-large", payload
    finally:
        sending.cancel()
        await asyncio.gather(sending, return_exceptions=True)
        writer.close()
    assert await events_holding(pg, marker) == 0


async def test_a_declared_body_over_the_limit_is_refused_before_it_is_read(base):
    """Content-Length over the limit: 413 at once, from the header (the body is never read)."""
    reader, writer = await asyncio.open_connection(*base.removeprefix("http://").split(":"))
    try:
        writer.write(f"POST /v1/conversations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {BODY_LIMIT + 1}\r\n".encode() + auth_lines() + b'\r\n{"title": "')
        await writer.drain()
        head, payload = await read_reply(reader)
        assert head.startswith(b"HTTP/1.1 413"), head
        assert payload["code"] == "too-large", payload
    finally:
        writer.close()


async def test_too_many_mcp_servers_are_refused(http):
    refused(await http.post("/v1/conversations", json={"settings": {"mcpServers": ["s"] * 101}}, timeout=30),
            422, "invalid-payload")


async def test_an_oversized_attachment_name_is_refused(http, conv, pg):
    before = await stream_version(pg, f"conversation:{conv}")
    r = await http.post(f"/v1/conversations/{conv}/attachments", timeout=30,
                   files={"file": ("n" * 300 + ".txt", b"hello", "text/plain")})
    refused(r, 413, "too-large")
    assert await stream_version(pg, f"conversation:{conv}") == before


# ------------------------------------------------------------------------------------------------ path ids

BAD_IDS = {"space": "a%20b", "nul": "%00", "5000-chars": "c" * 5000, "dot-dot": "%2E%2E"}
ROUTES = {
    "attach": ("POST", "/v1/conversations/{bad}/attachments"),
    "turn": ("POST", "/v1/conversations/{bad}/turns"),
    "regenerate": ("POST", "/v1/conversations/{cid}/turns/{bad}/regenerate"),
    "abort": ("POST", "/v1/conversations/{cid}/turns/{bad}/abort"),
    "events": ("GET", "/v1/conversations/{cid}/turns/{bad}/events"),
    "turn-log": ("GET", "/v1/conversations/{bad}/turns/{tid}"),
    "served-request": ("GET", "/v1/conversations/{cid}/turns/{bad}/steps/1/request"),
    "messages": ("GET", "/v1/conversations/{bad}/messages"),
    "anchor": ("GET", "/v1/conversations/{cid}/messages?anchor={bad}"),
    "result-message": ("GET", "/v1/conversations/{cid}/messages/{bad}/results/call_1"),
    "result-call": ("GET", "/v1/conversations/{cid}/messages/{mid}/results/{bad}"),
}


@pytest.mark.parametrize("bad", BAD_IDS.values(), ids=BAD_IDS.keys())
@pytest.mark.parametrize("route", ROUTES.values(), ids=ROUTES.keys())
async def test_a_malformed_id_is_refused_in_every_route(http, conv, pg, route, bad):
    method, template = route
    tid = await pg.fetchval("SELECT data->>'turnId' FROM persistence.events WHERE stream_id = $1 AND version = 1",
                            f"conversation-turns:{conv}")
    before = (await stream_version(pg, f"conversation:{conv}"), await stream_version(pg, f"turn:{tid}"))
    url = template.format(bad=bad, cid=conv, tid=tid, mid="msg_0123")
    kwargs = {"files": {"file": ("a.txt", b"a", "text/plain")}} if template.endswith("attachments") else (
        {"json": {"text": "x", "provider": REPLAY}} if method == "POST" else {})
    body = refused(await http.request(method, url, **kwargs), 422, "invalid-payload")
    assert "pattern" in body["message"] or "at most 128" in body["message"], body
    assert (await stream_version(pg, f"conversation:{conv}"), await stream_version(pg, f"turn:{tid}")) == before


# ------------------------------------------------------------------------------------- one turn per conversation

async def test_five_concurrent_turns_give_one_202_and_four_409s(http, pg):
    cid = (await http.post("/v1/conversations", json={"title": "race"}, timeout=30)).json()["id"]
    rs = await asyncio.gather(*(http.post(f"/v1/conversations/{cid}/turns", json={
        "text": f"racer {i}", "provider": {"kind": "replay", "script": LONG_SCRIPT}, "maxSteps": 20})
        for i in range(5)))
    assert sorted(r.status_code for r in rs) == [202, 409, 409, 409, 409], [(r.status_code, r.text) for r in rs]
    for r in rs:
        if r.status_code == 409:
            assert r.json()["code"] == "turn-in-progress" and "one turn runs per conversation" in r.json()["message"]
    [winner] = [r.json() for r in rs if r.status_code == 202]
    # exactly one user message and one admission: nothing of the refused four was stored
    users = await pg.fetchval("SELECT count(*) FROM persistence.events WHERE stream_id = $1 "
                              "AND type = 'UserMessageAdded'", f"conversation:{cid}")
    assert users == 1 and await stream_version(pg, f"conversation-turns:{cid}") == 1
    # while it runs, a regenerate is refused too; an abort ends it and frees the conversation
    regen = await http.post(f"/v1/conversations/{cid}/turns/{winner['turnId']}/regenerate", timeout=30)
    if regen.status_code == 202:  # the turn had already ended (a very slow machine): nothing left to refuse
        await wait_terminal(http, cid, regen.json()["turnId"])
    else:
        refused(regen, 409, "turn-in-progress")
        await http.post(f"/v1/conversations/{cid}/turns/{winner['turnId']}/abort", timeout=30)
    await wait_terminal(http, cid, winner["turnId"])
    winner_text = next(f"racer {i}" for i, r in enumerate(rs) if r.status_code == 202)
    msgs = (await http.get(f"/v1/conversations/{cid}/messages", timeout=30)).json()["messages"]
    assert [m["parts"][0]["text"] for m in msgs if m["role"] == "user"] == [winner_text]
    nxt = await http.post(f"/v1/conversations/{cid}/turns", json={"text": "after", "provider": REPLAY}, timeout=30)
    assert nxt.status_code == 202, nxt.text
    assert (await wait_terminal(http, cid, nxt.json()["turnId"]))["type"] == "TurnCompleted"


async def test_a_turn_right_after_the_previous_one_ended_is_accepted(http):
    cid = (await http.post("/v1/conversations", json={}, timeout=30)).json()["id"]
    for text in ("one", "two", "three"):
        r = await http.post(f"/v1/conversations/{cid}/turns", json={"text": text, "provider": REPLAY}, timeout=30)
        assert r.status_code == 202, r.text
        assert (await wait_terminal(http, cid, r.json()["turnId"]))["type"] == "TurnCompleted"
    msgs = (await http.get(f"/v1/conversations/{cid}/messages", timeout=30)).json()["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant"] * 3  # one branch, no silent siblings


# ------------------------------------------------------------------------------------------------ persistence

@pytest.mark.parametrize("data", [{"conversationId": "c", "title": "a\x00b"}, {"conversationId": "c",
                                                                                  "title": "a\ud800b"}],
                         ids=["nul-title", "surrogate-title"])
async def test_persistence_refuses_at_append_what_it_could_never_project(base, rpc, pg, data):
    stream = f"conversation:conv_{uuid.uuid4().hex[:20]}"
    with pytest.raises(RemoteError) as err:
        await append(rpc, stream, [event("ConversationCreated", data)], expected=0)
    assert err.value.code == "invalid-payload" and "cannot be stored" in err.value.message
    assert await stream_version(pg, stream) == 0


async def insert_behind_the_service(pg, stream: str, type_: str, data_json: str) -> int:
    """An event as an older (unchecked) writer stored it: same outbox row, no validation."""
    async with pg.transaction():
        position = await pg.fetchval(
            "INSERT INTO persistence.events (stream_id, version, event_id, type, data) VALUES ($1, 1, $2, $3, "
            "$4::json) RETURNING position", stream, uuid.uuid4(), type_, data_json)
        await pg.execute("INSERT INTO persistence.outbox (position) VALUES ($1)", position)
    return position


async def projection_at(pg, position: int) -> None:
    for _ in range(600):  # the projector polls every second when idle; a batch is milliseconds
        # the log's order is (writing transaction, position): the projector is past the event when its cursor is
        if await pg.fetchval(
                "SELECT (c.tx, c.position) >= (e.tx, e.position) FROM persistence.projection_tracking t "
                "JOIN persistence.events c ON c.position = t.position, persistence.events e "
                "WHERE t.name = 'conversation' AND e.position = $1", position):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the projection never reached position {position}")



WEDGING = {
    "nul-title": ("ConversationCreated", r'{"conversationId":"x","title":"a\u0000b"}', "NUL"),
    "surrogate-title": ("ConversationCreated", r'{"conversationId":"x","title":"a\ud800b"}', "surrogate"),
    "nul-message-id": ("UserMessageAdded",
                       r'{"message":{"id":"m\u0000","role":"user","parts":[{"type":"text","text":"t"}]}}', "NUL"),
}


@pytest.mark.parametrize("case", WEDGING.values(), ids=WEDGING.keys())
async def test_an_event_the_projection_cannot_apply_is_parked_and_the_rest_goes_on(http, stack, rpc, pg, case):
    type_, data_json, why = case
    bad_cid = f"conv_{uuid.uuid4().hex[:20]}"
    position = await insert_behind_the_service(pg, f"conversation:{bad_cid}", type_, data_json)
    # another conversation written after it: the projection must get past the bad event to serve it
    cid = (await http.post("/v1/conversations", json={"title": "a neighbour"}, timeout=30)).json()["id"]
    neighbour = await append(rpc, f"conversation:{cid}", [event("UserMessageAdded", {"message": {
        "id": "msg_n1", "role": "user", "parts": [{"type": "text", "text": "hello"}]}})])
    await projection_at(pg, neighbour["positions"][-1])
    hist = await projection_history(stack, cid)  # the service folds a conversation this short
    assert hist["source"] == "projection" and hist["messages"][0]["parts"][0]["text"] == "hello"
    await projection_at(pg, position)
    parked = await pg.fetchrow("SELECT stream_id, type, reason FROM persistence.parked_events WHERE position = $1",
                               position)
    assert parked is not None and parked["stream_id"] == f"conversation:{bad_cid}" and parked["type"] == type_
    assert why in parked["reason"], parked["reason"]
    assert await pg.fetchval("SELECT last_error FROM persistence.projection_tracking "
                             "WHERE name = 'conversation'") is None
    async with httpx.AsyncClient(base_url=stack.env["CTX_PERSISTENCE_HTTP"], timeout=10) as persistence:
        status = (await persistence.get("/projection")).json()
    assert status["parkedEvents"] >= 1 and status["position"] >= position


async def test_the_parked_conversation_itself_is_folded_from_its_events(base, rpc, pg, stack):
    bad_cid = f"conv_{uuid.uuid4().hex[:20]}"
    position = await insert_behind_the_service(pg, f"conversation:{bad_cid}", "ConversationCreated",
                                               r'{"conversationId":"x","title":"a\u0000b"}')
    await projection_at(pg, position)
    hist = await rpc.call("ctx.persist.history", {"conversationId": bad_cid})
    assert hist["source"] == "fold" and hist["title"] == "a\x00b"
    # folded for being short too: a replica that reads the projection of any conversation folds it for the parked
    # event (the projection is past it)
    assert await projection_history(stack, bad_cid) == hist


async def test_a_nul_inside_a_message_body_is_projected_not_parked(http, rpc, pg, stack):
    """JSON columns keep a NUL as \\u0000: a message whose text holds one is stored, projected and read back
    byte for byte (it used to fail the messages row's generated columns, migration 0004)."""
    cid = (await http.post("/v1/conversations", json={"title": "binary-ish"}, timeout=30)).json()["id"]
    text = "before\x00after"
    result = await append(rpc, f"conversation:{cid}", [event("UserMessageAdded", {"message": {
        "id": "msg_nul", "role": "user", "parts": [{"type": "text", "text": text}]}})])
    await projection_at(pg, result["positions"][-1])
    hist = await projection_history(stack, cid)  # the service folds a conversation this short
    assert hist["source"] == "projection" and hist["messages"][0]["parts"][0]["text"] == text
    assert await pg.fetchval("SELECT count(*) FROM persistence.parked_events WHERE position = $1",
                             result["positions"][0]) == 0
