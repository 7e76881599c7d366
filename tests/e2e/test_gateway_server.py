"""The drop-in gateway's server side on the real stack (SPEC §15.5): /v1/chat/completions and /v1/messages over
the durable turn path, the upstream being the local wire-format servers of tests/support. Conversation identity
(implicit by prefix, explicit, forks), client tools handed over and continued, ctxbuild's own tools run
server-side, streams, response headers, errors in each dialect's shape. (The real SDKs and frameworks against
it: tests/e2e/test_gateway_clients*.py.)"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading

import asyncpg
import httpx
import pytest
from ctxbuild_devstack import free_port
from ctxbuild_devstack.replica import Replica

from tests.support.auth import AUTH
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.server import serving

pytestmark = pytest.mark.e2e

MODEL = "fake-model"  # in this module's model table: openai upstream, a 64k window
CLAUDE = "fake-claude"  # anthropic upstream
STREAM, SUBJECT, CONSUMER = "CTX_TURNS_GW", "ctx.turn.run.gw", "turn-runner-gw"
TABLE = {MODEL: {"dialect": "openai", "contextWindow": 64000},
         CLAUDE: {"dialect": "anthropic", "contextWindow": 32000, "upstreamModel": "claude-upstream"}}


@pytest.fixture(scope="module")
def fake_anthropic():
    yield from serving(FakeAnthropic(free_port()))


@pytest.fixture(scope="module")
def gw(stack, all_services, fake_openai, fake_anthropic) -> str:
    """An orchestration replica (edge + runner) on its own work queue, both upstreams configured, this module's
    model table and no passthrough (an unknown model is a 404)."""
    r = Replica(stack, "orchestration", "orch-gateway", CTX_ROLE="all", CTX_TURNS_STREAM=STREAM,
                CTX_TURNS_SUBJECT=SUBJECT, CTX_TURNS_CONSUMER=CONSUMER,
                CTX_OPENAI_BASE_URL=fake_openai.base_url, CTX_ANTHROPIC_BASE_URL=fake_anthropic.base_url,
                CTX_GATEWAY_MODELS=json.dumps(TABLE), CTX_GATEWAY_PASSTHROUGH="false",
                CTX_DRAIN_TIMEOUT_S="1").wait_ready()  # nothing left running at the module's end: a short drain
    yield r.url
    r.stop()


def chat(*messages: dict, **extra) -> dict:
    return {"model": MODEL, "messages": list(messages), **extra}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def call(cid: str, name: str, args: dict) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


async def path_of(http: httpx.AsyncClient, cid: str) -> list[dict]:
    return (await http.get(f"/v1/conversations/{cid}/messages")).json()["messages"]


async def turn_log(http: httpx.AsyncClient, cid: str, tid: str) -> dict:
    return (await http.get(f"/v1/conversations/{cid}/turns/{tid}")).json()


async def events_of(stack, *streams: str) -> list[dict]:
    """The stored events of the streams as Postgres holds them, with the writing transaction (``tx``)."""
    conn = await asyncpg.connect(stack.env["CTX_DATABASE_URL"])
    try:
        rows = await conn.fetch("SELECT stream_id, version, type, tx::text AS tx FROM persistence.events "
                                "WHERE stream_id = ANY($1) ORDER BY position", list(streams))
    finally:
        await conn.close()
    return [dict(r) for r in rows]


async def prefix_records(stack, cid: str) -> list[dict]:
    """The conversation's GatewayPrefixRecorded events (index — a request's messages only —, message, writing
    transaction), in log order."""
    conn = await asyncpg.connect(stack.env["CTX_DATABASE_URL"])
    try:
        rows = await conn.fetch("SELECT (data->>'index')::int AS index, data->>'messageId' AS message_id, "
                                "tx::text AS tx FROM persistence.events WHERE type = 'GatewayPrefixRecorded' "
                                "AND data->>'conversationId' = $1 ORDER BY position", cid)
    finally:
        await conn.close()
    return [dict(r) for r in rows]


def sse_data(raw: str) -> list[str]:
    return [line[len("data: "):] for line in raw.splitlines() if line.startswith("data: ")]


async def test_a_plain_request_then_its_continuation(gw, fake_openai):
    """No tools: one turn per request; the follow-up (the answer resent + a new question) continues the same
    conversation under the answer; headers name the conversation, the turn, served tokens and overhead."""
    async with httpx.AsyncClient(base_url=gw, headers=AUTH, timeout=60) as http:
        fake_openai.reply_next = {"role": "assistant", "content": "Paris."}
        r = await http.post("/v1/chat/completions", json=chat(
            {"role": "system", "content": "Be brief."}, user("Capital of France?")))
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        assert body["choices"][0]["message"]["content"] == "Paris."
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"]["prompt_tokens"] > 0 and body["usage"]["completion_tokens"] == 12
        cid, tid = r.headers["x-ctx-conversation-id"], r.headers["x-ctx-turn-id"]
        assert tid.startswith("turn_") and int(r.headers["x-ctx-served-tokens"]) > 0
        assert float(r.headers["x-ctx-overhead-ms"]) >= 0
        upstream = fake_openai.requests[-1]
        # the client's system prompt is served after ctxbuild's own; no tools offered for a plain chat
        assert upstream["messages"][0]["role"] == "system"
        assert upstream["messages"][0]["content"].endswith("\n\nBe brief.")
        assert not upstream.get("tools")
        assert "stream" not in upstream  # the client waits for one whole answer: so does the gateway

        fake_openai.reply_next = {"role": "assistant", "content": "About 2.1 million."}
        r2 = await http.post("/v1/chat/completions", json=chat(
            {"role": "system", "content": "Be brief."}, user("Capital of France?"),
            {"role": "assistant", "content": "Paris."}, user("Population?")))
        assert r2.status_code == 200, r2.text
        assert r2.headers["x-ctx-conversation-id"] == cid and r2.headers["x-ctx-turn-id"] != tid
        path = await path_of(http, cid)
        # another system prompt is another conversation (the chain is seeded by tenant and system prompt)
        fake_openai.reply_next = {"role": "assistant", "content": "Paris!"}
        r3 = await http.post("/v1/chat/completions", json=chat(user("Capital of France?")))
        assert r3.headers["x-ctx-conversation-id"] != cid
    assert [(m["role"], m["parts"][0]["text"]) for m in path] == [
        ("user", "Capital of France?"), ("assistant", "Paris."), ("user", "Population?"),
        ("assistant", "About 2.1 million.")]
    # the served history is the stored conversation (the resent answer is not stored twice)
    served = [m["content"] for m in fake_openai.requests[-2]["messages"] if m["role"] != "system"]
    assert served == ["Capital of France?", "Paris.", "Population?"]


async def test_requests_without_an_answer_taken_for_new_still_find_their_conversation(gw, fake_openai, stack):
    """A request with no answer in it is taken for a new conversation without a lookup: the admission's commit
    refuses it when one of its prefixes is recorded, and it is then looked up. So a resent first message (a retry)
    still answers its stored message in its conversation, and a request that adds a second question under a stored
    first one still continues it — each message stored once, each prefix recorded once."""
    async with httpx.AsyncClient(base_url=gw, headers=AUTH, timeout=60) as http:
        fake_openai.reply_next = {"role": "assistant", "content": "first"}
        r1 = await http.post("/v1/chat/completions", json=chat(user("taken for new: hello")))
        assert r1.status_code == 200, r1.text
        cid = r1.headers["x-ctx-conversation-id"]
        fake_openai.reply_next = {"role": "assistant", "content": "again"}
        r2 = await http.post("/v1/chat/completions", json=chat(user("taken for new: hello")))
        assert r2.status_code == 200, r2.text
        assert r2.headers["x-ctx-conversation-id"] == cid and r2.headers["x-ctx-turn-id"] != r1.headers[
            "x-ctx-turn-id"]
        assert r2.json()["choices"][0]["message"]["content"] == "again"
        fake_openai.reply_next = {"role": "assistant", "content": "more"}
        r3 = await http.post("/v1/chat/completions", json=chat(user("taken for new: hello"), user("and more")))
        assert r3.status_code == 200, r3.text
        assert r3.headers["x-ctx-conversation-id"] == cid
        path = await path_of(http, cid)
    assert [(m["role"], m["parts"][0]["text"]) for m in path] == [
        ("user", "taken for new: hello"), ("user", "and more"), ("assistant", "more")]
    # the retry was served the stored question once, not a second copy of it
    assert [m["content"] for m in fake_openai.requests[-2]["messages"] if m["role"] != "system"] == [
        "taken for new: hello"]
    asked = sorted(r["index"] for r in await prefix_records(stack, cid) if r["index"] is not None)
    assert asked == [1, 2]


async def test_a_new_conversations_first_turn_reads_nothing_back(gw, fake_openai, stack):
    """The messages a request's commit creates a conversation with ride to the runner with its command: the first
    turn serves them without a ctx.persist.history read, byte for byte as the next turn, which reads them back,
    serves them again (its request starts with the first one's)."""
    import nats

    nc = await nats.connect(stack.env["CTX_NATS_URL"])
    reads: list[dict] = []

    async def seen(msg) -> None:
        reads.append(json.loads(msg.data))

    await nc.subscribe("ctx.persist.history", cb=seen)  # beside persistence's queue group: sees every request
    try:
        async with httpx.AsyncClient(base_url=gw, headers=AUTH, timeout=60) as http:
            first = [{"role": "system", "content": "Answer in one word."}, user("carried: a first question"),
                     user("carried: and a second one")]
            fake_openai.reply_next = {"role": "assistant", "content": "One."}
            r1 = await http.post("/v1/chat/completions", json=chat(*first))
            assert r1.status_code == 200, r1.text
            cid = r1.headers["x-ctx-conversation-id"]
            served1 = fake_openai.requests[-1]["messages"]
            await nc.flush()
            assert [q for q in reads if q.get("conversationId") == cid] == []
            fake_openai.reply_next = {"role": "assistant", "content": "Two."}
            r2 = await http.post("/v1/chat/completions", json=chat(*first, {"role": "assistant", "content": "One."},
                                                                   user("carried: a third")))
            assert r2.status_code == 200 and r2.headers["x-ctx-conversation-id"] == cid
            served2 = fake_openai.requests[-1]["messages"]
            await nc.flush()
    finally:
        await nc.close()
    assert [q for q in reads if q.get("conversationId") == cid]  # the continuation read its window back
    assert [m["content"] for m in served1 if m["role"] == "user"] == [
        "carried: a first question", "carried: and a second one"]
    assert json.dumps(served2[:len(served1)]) == json.dumps(served1)


async def test_a_turn_that_made_no_provisional_reference_releases_none(gw, fake_openai, stack):
    """A turn's provisional references (offloads, checkpoints, client results through the lane) are released at
    its end; a first attempt that made none — a plain answer — asks the blob store for nothing. A request whose
    client tool results went through the lane does release."""
    import nats

    nc = await nats.connect(stack.env["CTX_NATS_URL"])
    released: list[bytes] = []

    async def seen(msg) -> None:
        released.append(msg.data)

    await nc.subscribe("ctx.blob.release", cb=seen)  # beside the blob store's queue group: sees every request
    try:
        async with httpx.AsyncClient(base_url=gw, headers=AUTH, timeout=60) as http:
            fake_openai.reply_next = {"role": "assistant", "content": "plain"}
            r1 = await http.post("/v1/chat/completions", json=chat(user("no references: hello")))
            assert r1.status_code == 200, r1.text
            call = {"id": "call_lane_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}}
            fake_openai.reply_next = {"role": "assistant", "content": "cold"}
            r2 = await http.post("/v1/chat/completions", json=chat(
                user("through the lane: weather?"), {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_lane_1", "content": "minus five"}, tools=[WEATHER]))
            assert r2.status_code == 200, r2.text
        for _ in range(50):  # the release follows the end notice
            await nc.flush()
            if any(r2.headers["x-ctx-turn-id"].encode() in m for m in released):
                break
            await asyncio.sleep(0.1)
    finally:
        await nc.close()
    assert not [m for m in released if r1.headers["x-ctx-turn-id"].encode() in m]
    assert [m for m in released if r2.headers["x-ctx-turn-id"].encode() in m]


async def test_an_edited_earlier_message_forks_a_branch(gw, fake_openai):
    async with httpx.AsyncClient(base_url=gw, headers=AUTH, timeout=60) as http:
        first = [user("fork: tell me a fruit")]
        fake_openai.reply_next = {"role": "assistant", "content": "apple"}
        r1 = await http.post("/v1/chat/completions", json=chat(*first))
        cid = r1.headers["x-ctx-conversation-id"]
        fake_openai.reply_next = {"role": "assistant", "content": "red"}
        await http.post("/v1/chat/completions", json=chat(*first, {"role": "assistant", "content": "apple"},
                                                         user("its colour?")))
        # the client edits its second question: the same conversation, a sibling of "its colour?"
        fake_openai.reply_next = {"role": "assistant", "content": "round"}
        r3 = await http.post("/v1/chat/completions", json=chat(*first, {"role": "assistant", "content": "apple"},
                                                              user("its shape?")))
        assert r3.headers["x-ctx-conversation-id"] == cid
        tree = (await http.get(f"/v1/conversations/{cid}/messages", params={"branches": "true"})).json()
    texts = [m["parts"][0]["text"] for m in tree["messages"]]
    assert texts == ["fork: tell me a fruit", "apple", "its shape?", "round"]
    shape = tree["messages"][2]
    assert len(tree["branches"][shape["id"]]) == 2  # "its colour?" and "its shape?" hang under "apple"
    served = [m["content"] for m in fake_openai.requests[-1]["messages"] if m["role"] != "system"]
    assert served == ["fork: tell me a fruit", "apple", "its shape?"]


async def test_client_tools_are_handed_over_and_their_large_results_trimmed(gw, fake_openai):
    """The model calls the client's tool: the turn ends with the call pending and the client gets it; its result
    (large) arrives on the next request, is trimmed by the in-flight lane and stored trimmed; the model reads it
    back in full through fs_read, run server-side (the client never sees that call); resent byte-identical, the
    result renders exactly as the model first saw it."""
    output = "".join(f"row {i}: " + "weather data " * 8 + "\n" for i in range(600))  # ~66 KB: two fs_read pages
    question = user("What is the weather? [[fake: steps=1 parallel=1 readback=new]]")
    tools = [WEATHER]
    async with httpx.AsyncClient(base_url=gw, headers=AUTH, timeout=60) as http:
        r1 = await http.post("/v1/chat/completions", json=chat(question, tools=tools))
        assert r1.status_code == 200, r1.text
        msg = r1.json()["choices"][0]
        assert msg["finish_reason"] == "tool_calls"
        (tc,) = msg["message"]["tool_calls"]
        assert tc["function"]["name"] == "get_weather" and json.loads(tc["function"]["arguments"]) == {
            "step": 1, "part": 1}
        cid, tid = r1.headers["x-ctx-conversation-id"], r1.headers["x-ctx-turn-id"]
        log = await turn_log(http, cid, tid)
        done = log["events"][-1]
        assert done["type"] == "TurnCompleted" and done["data"]["stopReason"] == "tool_calls"
        assert done["data"]["pendingToolCalls"] == [tc["id"]]
        # nothing archived yet, no server-side tools: the client's tool alone
        assert {t["function"]["name"] for t in fake_openai.requests[-1]["tools"]} == {"get_weather"}

        history = [question, {"role": "assistant", "content": msg["message"]["content"], "tool_calls": [tc]},
                   {"role": "tool", "tool_call_id": tc["id"], "content": output}]
        n0 = len(fake_openai.requests)
        r2 = await http.post("/v1/chat/completions", json=chat(*history, tools=tools))
        assert r2.status_code == 200, r2.text
        assert r2.headers["x-ctx-conversation-id"] == cid
        answer = r2.json()["choices"][0]
        assert answer["finish_reason"] == "stop" and "tool_calls" not in answer["message"]
        text = answer["message"]["content"]
        assert f"chars={len(output.rstrip(chr(10)))} " in text or f"chars={len(output)} " in text, text
        sha = hashlib.sha256(output.encode()).hexdigest()
        sha_stripped = hashlib.sha256(output.rstrip("\n").encode()).hexdigest()
        assert f"sha256={sha}" in text or f"sha256={sha_stripped}" in text, text
        served = fake_openai.requests[n0:]
        assert len(served) >= 2  # the fs_read pages ran server-side, inside this one request
        # the trimmed result's archive is readable: ctxbuild's fs_read offered beside the client's tool
        assert {t["function"]["name"] for t in served[0]["tools"]} == {"fs_read", "get_weather"}
        first_view = next(m for m in served[0]["messages"] if m["role"] == "tool")["content"]
        assert len(first_view) < len(output) // 10 and "fs_read" in first_view  # trimmed, with its URI

        # the conversation goes on: the client resends everything; the stored (trimmed) result renders the same
        fake_openai.reply_next = {"role": "assistant", "content": "Anything else?"}
        r3 = await http.post("/v1/chat/completions", json=chat(
            *history, {"role": "assistant", "content": text}, user("thanks"), tools=tools))
        assert r3.status_code == 200 and r3.headers["x-ctx-conversation-id"] == cid
        again = next(m for m in fake_openai.requests[-1]["messages"] if m["role"] == "tool"
                     and m["tool_call_id"] == tc["id"])["content"]
        assert again == first_view
        path = await path_of(http, cid)
    tool_msgs = [m for m in path if m["role"] == "tool"]
    client_result = next(p for m in tool_msgs for p in m["parts"] if p["toolCallId"] == tc["id"])
    assert client_result["offload"]["uri"] in first_view  # stored trimmed, its archive named


async def test_a_step_mixing_client_and_server_calls(gw, fake_openai):
    """One step calls the client's tool and ctxbuild's fs_read: fs_read runs here and is stored with its result;
    the client sees only its own call; its result continues the turn after the server-side result."""
    tools = [WEATHER]
    async with httpx.AsyncClient(base_url=gw, headers=AUTH, timeout=60) as http:
        fake_openai.reply_next = {"role": "assistant", "content": "Checking.", "tool_calls": [
            call("call_mix_c", "get_weather", {"city": "Oslo"}),
            call("call_mix_s", "fs_read", {"uri": "context://vfs/nothing-here"})]}
        q = user("mixed: weather in Oslo?")
        r1 = await http.post("/v1/chat/completions", json=chat(q, tools=tools))
        assert r1.status_code == 200, r1.text
        m1 = r1.json()["choices"][0]["message"]
        assert [c["id"] for c in m1["tool_calls"]] == ["call_mix_c"] and m1["content"] == "Checking."
        cid = r1.headers["x-ctx-conversation-id"]
        path = await path_of(http, cid)
        assert [m["role"] for m in path] == ["user", "assistant", "tool"]
        assert [p["toolCallId"] for p in path[2]["parts"]] == ["call_mix_s"]  # the server-side result only

        fake_openai.reply_next = {"role": "assistant", "content": "Cold."}
        r2 = await http.post("/v1/chat/completions", json=chat(
            q, {"role": "assistant", "content": "Checking.", "tool_calls": m1["tool_calls"]},
            {"role": "tool", "tool_call_id": "call_mix_c", "content": "-3 C"}, tools=tools))
        assert r2.status_code == 200, r2.text
        assert r2.headers["x-ctx-conversation-id"] == cid
    wire = fake_openai.requests[-1]["messages"]
    assert [m.get("tool_call_id") for m in wire if m["role"] == "tool"] == ["call_mix_s", "call_mix_c"]
    assert len(next(m for m in wire if m["role"] == "assistant")["tool_calls"]) == 2


async def test_openai_stream(gw, fake_openai):
    async with httpx.AsyncClient(base_url=gw, headers=AUTH, timeout=60) as http:
        fake_openai.reply_next = {"role": "assistant", "content": "Streaming through the gateway works."}
        fake_openai.delay_next_s = 2.5  # a model slow to start: the stream keeps alive meanwhile
        async with http.stream("POST", "/v1/chat/completions", json=chat(
                user("stream please"), stream=True, stream_options={"include_usage": True})) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["x-ctx-conversation-id"].startswith("conv_")
            raw = "".join([t async for t in r.aiter_text()])
    data = sse_data(raw)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "Streaming through the gateway works."
    assert len([c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]) >= 3
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert ": x-ctx-served-tokens=" in raw and "x-ctx-overhead-ms=" in raw
    assert raw.index(": ping\n") < raw.index("Streaming")  # a keep-alive comment while the model was silent
    assert fake_openai.requests[-1]["stream"] is True  # a streamed request streams from the model


async def test_anthropic_messages_with_client_tools_streamed_and_not(gw, fake_anthropic):
    tools = [{"name": "lookup", "description": "look something up",
              "input_schema": {"type": "object", "properties": {"q": {"type": "integer"}}}}]
    headers = {**AUTH, "anthropic-version": "2023-06-01"}
    async with httpx.AsyncClient(base_url=gw, headers=headers, timeout=60) as http:
        body = {"model": CLAUDE, "max_tokens": 256, "system": "You are terse.", "tools": tools,
                "messages": [{"role": "user", "content": "look up q=1"}]}
        r1 = await http.post("/v1/messages", json=body)
        assert r1.status_code == 200, r1.text
        m1 = r1.json()
        assert m1["type"] == "message" and m1["stop_reason"] == "tool_use" and m1["model"] == CLAUDE
        use = next(b for b in m1["content"] if b["type"] == "tool_use")
        assert use["name"] == "lookup" and use["input"] == {"q": 1}
        upstream = fake_anthropic.requests[-1]
        assert upstream["model"] == "claude-upstream" and not upstream.get("stream")
        assert upstream["system"][0]["text"].endswith("\n\nYou are terse.")
        cid = r1.headers["x-ctx-conversation-id"]

        body["messages"] += [{"role": "assistant", "content": m1["content"]},
                             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                                           "content": "forty-two"}]}]
        body["stream"] = True
        async with http.stream("POST", "/v1/messages", json=body) as r:
            assert r.status_code == 200
            assert r.headers["x-ctx-conversation-id"] == cid
            raw = "".join([t async for t in r.aiter_text()])
    assert fake_anthropic.requests[-1]["stream"] is True  # a streamed request streams from the model
    names = [line[len("event: "):] for line in raw.splitlines() if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-1] == "message_stop" and "message_delta" in names
    deltas = [json.loads(d) for d in sse_data(raw)]
    text = "".join(d["delta"].get("text", "") for d in deltas if d["type"] == "content_block_delta")
    assert text == "got 1 result(s)"
    assert next(d for d in deltas if d["type"] == "message_delta")["delta"]["stop_reason"] == "end_turn"


async def test_models_and_errors_in_each_dialect(gw, fake_openai):
    async with httpx.AsyncClient(base_url=gw, timeout=60) as http:
        models = (await http.get("/v1/models", headers=AUTH)).json()
        assert models["object"] == "list"
        assert {(m["id"], m["context_window"]) for m in models["data"]} == {(MODEL, 64000), (CLAUDE, 32000)}

        bad = await http.post("/v1/chat/completions", json=chat(user("hi")), headers={"Authorization": "Bearer x"})
        assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
        bad = await http.post("/v1/messages", json={"model": CLAUDE, "max_tokens": 5, "messages": []},
                              headers={"x-api-key": "nope", "anthropic-version": "2023-06-01"})
        assert bad.status_code == 401
        assert bad.json() == {"type": "error", "error": {"type": "authentication_error",
                                                         "message": bad.json()["error"]["message"]}}
        unknown = await http.post("/v1/chat/completions", json={**chat(user("hi")), "model": "nope"}, headers=AUTH)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        unknown = await http.post("/v1/messages", headers=AUTH, json={
            "model": "nope", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
        garbled = await http.post("/v1/chat/completions", content=b"{not json", headers=AUTH)
        assert garbled.status_code == 400 and garbled.json()["error"]["type"] == "invalid_request_error"
        stranger = await http.post("/v1/chat/completions", json=chat(user("hi")),
                                   headers={**AUTH, "X-Ctx-Conversation-Id": "conv_doesnotexist"})
        assert stranger.status_code == 404 and "error" in stranger.json()
        odd = await http.post("/v1/chat/completions", json=chat(user("hi"), metadata={"conversation_id": "a b/../c"}),
                              headers=AUTH)
        assert odd.status_code == 400 and odd.json()["error"]["param"] == "metadata.conversation_id"

        fake_openai.fail_next = 400  # the upstream refuses: a gateway error (502) in the client's dialect
        failed = await http.post("/v1/chat/completions", json=chat(user("upstream refuses")), headers=AUTH)
        assert failed.status_code == 502 and failed.json()["error"]["type"] == "server_error"
        assert failed.headers["x-ctx-turn-id"].startswith("turn_")


async def test_one_running_turn_per_conversation(gw, fake_openai, stack):
    """A second request on a conversation whose turn is still running is refused (409, the dialect's shape);
    once the first ends the conversation takes requests again."""
    async with httpx.AsyncClient(base_url=gw, headers=AUTH, timeout=60) as http:
        fake_openai.reply_next = {"role": "assistant", "content": "ok"}
        r = await http.post("/v1/chat/completions", json=chat(user("busy: start")))
        cid = r.headers["x-ctx-conversation-id"]
        hold = threading.Event()
        fake_openai.hold_next = hold
        fake_openai.reply_next = {"role": "assistant", "content": "slow answer"}
        history = [user("busy: start"), {"role": "assistant", "content": "ok"}]
        first = asyncio.create_task(http.post("/v1/chat/completions", json=chat(*history, user("slow"))))
        for _ in range(200):
            if fake_openai.requests and fake_openai.requests[-1]["messages"][-1].get("content") == "slow":
                break
            await asyncio.sleep(0.05)
        busy = await http.post("/v1/chat/completions", json=chat(*history, user("meanwhile")),
                               headers={"X-Ctx-Conversation-Id": cid})
        hold.set()
        done = await first
        path = await path_of(http, cid)
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "conversation_busy"
    assert done.status_code == 200 and done.json()["choices"][0]["message"]["content"] == "slow answer"
    # the refused request stored nothing: its message is in no path, its turn was never admitted
    assert "meanwhile" not in json.dumps(path) and "slow" in json.dumps(path)
    admissions = await events_of(stack, f"conversation-turns:{cid}")
    assert len(admissions) == 2  # the first request's and the slow one's


async def test_tool_choice_and_options_reach_either_upstream(gw, fake_openai, fake_anthropic):
    """The client's tool choice, parallel-calls switch, max tokens and sampling options go upstream in the
    upstream's own terms — an OpenAI client on an Anthropic-served model included."""
    body = chat(user("choices: weather in Rome?"), tools=[WEATHER], temperature=0.2, stop=["END"], max_tokens=77,
                tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False,
                logprobs=True)
    async with httpx.AsyncClient(base_url=gw, headers=AUTH, timeout=60) as http:
        fake_openai.reply_next = {"role": "assistant", "content": None,
                                  "tool_calls": [call("call_choice", "get_weather", {"city": "Rome"})]}
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        sent = fake_openai.requests[-1]
        assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
        assert sent["parallel_tool_calls"] is False and sent["max_tokens"] == 77
        assert sent["temperature"] == 0.2 and sent["stop"] == ["END"] and "logprobs" not in sent

        fake_anthropic.reply_next = [{"type": "tool_use", "id": "toolu_choice", "name": "get_weather",
                                      "input": {"city": "Rome"}}]
        r = await http.post("/v1/chat/completions", json={**body, "model": CLAUDE})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["tool_calls"][0]["id"] == "toolu_choice"
        sent = fake_anthropic.requests[-1]
        assert sent["tool_choice"] == {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
        assert sent["temperature"] == 0.2 and sent["stop_sequences"] == ["END"] and sent["max_tokens"] == 77
        assert "stop" not in sent and "logprobs" not in sent


async def test_a_client_that_leaves_a_stream_aborts_its_turn(gw, fake_openai):
    """The client closes a streamed response while the model still thinks: the turn is aborted (its one terminal
    event), so the conversation is not held by a turn nobody waits for."""
    hold = threading.Event()
    fake_openai.hold_next = hold
    fake_openai.reply_next = {"role": "assistant", "content": "too late"}
    try:
        async with httpx.AsyncClient(base_url=gw, headers=AUTH, timeout=60) as http:
            async with http.stream("POST", "/v1/chat/completions",
                                   json=chat(user("leave: I will not wait"), stream=True)) as r:
                cid, tid = r.headers["x-ctx-conversation-id"], r.headers["x-ctx-turn-id"]
                async for _ in r.aiter_bytes():
                    break  # the role chunk came: the stream is open; the client goes away
            for _ in range(300):
                log = await turn_log(http, cid, tid)
                if log["status"] in ("completed", "failed"):
                    break
                await asyncio.sleep(0.1)
    finally:
        hold.set()
    assert log["status"] == "failed" and log["error"]["code"] == "aborted", log.get("error")


async def test_a_turn_started_elsewhere_still_holds_the_conversation(gw, fake_openai):
    """The gateway remembers the admission of the last turn it saw end and admits the next request right after
    it without reading; a turn started meanwhile through the API (here: still running) makes that append
    conflict, and the request is refused as busy (409) as it would be on any replica."""
    async with httpx.AsyncClient(base_url=gw, headers=AUTH, timeout=60) as http:
        fake_openai.reply_next = {"role": "assistant", "content": "first"}
        history = [user("elsewhere: hello")]
        r = await http.post("/v1/chat/completions", json=chat(*history))
        cid = r.headers["x-ctx-conversation-id"]
        hold = threading.Event()
        fake_openai.hold_next = hold
        fake_openai.reply_next = {"role": "assistant", "content": "from the API"}
        try:
            api_turn = await http.post(f"/v1/conversations/{cid}/turns", json={
                "text": "through the API", "provider": {"kind": "openai", "model": MODEL}})
            assert api_turn.status_code == 202, api_turn.text
            busy = await http.post("/v1/chat/completions", json=chat(
                *history, {"role": "assistant", "content": "first"}, user("and now?")))
        finally:
            hold.set()
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "conversation_busy"
        for _ in range(300):
            if (await turn_log(http, cid, api_turn.json()["turnId"]))["status"] == "completed":
                break
            await asyncio.sleep(0.1)
        fake_openai.reply_next = {"role": "assistant", "content": "now free"}
        again = await http.post("/v1/chat/completions", json=chat(
            *history, {"role": "assistant", "content": "first"}, user("and now?")))
    assert again.status_code == 200 and again.headers["x-ctx-conversation-id"] == cid


async def test_a_request_is_admitted_stored_and_queued_in_one_commit(gw, fake_openai, stack):
    """A new conversation's admission, creation, message and turn command are written by one transaction, and so
    are a continuation's admission, new messages and command (``ctx.persist.append_batch``): never a half-stored
    request."""
    async with httpx.AsyncClient(base_url=gw, headers=AUTH, timeout=60) as http:
        fake_openai.reply_next = {"role": "assistant", "content": "one"}
        r = await http.post("/v1/chat/completions", json=chat(user("one commit: hello")))
        assert r.status_code == 200, r.text
        cid, tid = r.headers["x-ctx-conversation-id"], r.headers["x-ctx-turn-id"]
        fake_openai.reply_next = {"role": "assistant", "content": "two"}
        r2 = await http.post("/v1/chat/completions", json=chat(
            user("one commit: hello"), {"role": "assistant", "content": "one"}, user("and again")))
        assert r2.status_code == 200 and r2.headers["x-ctx-conversation-id"] == cid
        tid2 = r2.headers["x-ctx-turn-id"]
        fake_openai.reply_next = {"role": "assistant", "content": "three"}
        api = await http.post(f"/v1/conversations/{cid}/turns", json={
            "text": "through the API", "provider": {"kind": "openai", "model": MODEL}})
        assert api.status_code == 202, api.text
        tid3 = api.json()["turnId"]
        for _ in range(300):
            if (await turn_log(http, cid, tid3))["status"] == "completed":
                break
            await asyncio.sleep(0.1)
    # the API's path: admission first (then the parent is read), the message and the command in one commit
    api_rows = await events_of(stack, f"conversation:{cid}", f"turn:{tid3}")
    queued3 = next(r for r in api_rows if r["stream_id"] == f"turn:{tid3}" and r["type"] == "TurnQueued")
    assert [(r["stream_id"], r["type"]) for r in api_rows if r["tx"] == queued3["tx"]] == [
        (f"conversation:{cid}", "UserMessageAdded"), (f"turn:{tid3}", "TurnQueued")]
    rows = await events_of(stack, f"conversation-turns:{cid}", f"conversation:{cid}", f"turn:{tid}", f"turn:{tid2}")
    first = [(r["stream_id"], r["type"]) for r in rows if r["tx"] == rows[0]["tx"]]
    assert first == [(f"conversation-turns:{cid}", "TurnAdmitted"), (f"conversation:{cid}", "ConversationCreated"),
                     (f"conversation:{cid}", "UserMessageAdded"), (f"turn:{tid}", "TurnQueued")]
    queued2 = next(r for r in rows if r["stream_id"] == f"turn:{tid2}" and r["type"] == "TurnQueued")
    second = [(r["stream_id"], r["type"]) for r in rows if r["tx"] == queued2["tx"]]
    assert second == [(f"conversation-turns:{cid}", "TurnAdmitted"), (f"conversation:{cid}", "UserMessageAdded"),
                      (f"turn:{tid2}", "TurnQueued")]
    # a request's new messages are findable by their prefix from the commit that stores them, never before
    records = await prefix_records(stack, cid)
    asked = {r["index"]: r["tx"] for r in records if r["index"] is not None}  # the edge's, for the questions
    assert asked == {1: rows[0]["tx"], 3: queued2["tx"]}
    answered = [r["tx"] for r in records if r["index"] is None]  # the runner's, for the two gateway answers
    completed = {r["stream_id"]: r["tx"] for r in rows if r["type"] == "TurnCompleted"}
    assert answered == [completed[f"turn:{tid}"], completed[f"turn:{tid2}"]]  # each in its turn's closing commit
    # a non-streamed request answered at once: its TurnStarted (lazy) and a turn-start decision that folded nothing
    # are written with the turn's next append — here its closing commit, the turn's only write after its command
    closing = [r["type"] for r in rows if r["stream_id"] == f"turn:{tid}" and r["tx"] == completed[f"turn:{tid}"]]
    assert closing == ["TurnStarted", "CompactionDecided", "StepServed", "TurnCompleted"]
    assert [r["type"] for r in rows if r["stream_id"] == f"turn:{tid}"] == ["TurnQueued", *closing]


async def test_concurrent_identical_new_requests_each_get_an_answer(gw, fake_openai, stack):
    """Identical requests sent at once on a new conversation race for its prefix record (first writer wins). Each
    is taken for new (no answer in it), so its commit is where it meets the winner's record: it is then looked up
    and continues the winner's conversation, as a retry does (busy while the winner's turn runs); one that loses
    the race again after that lookup is not refused: it runs in a conversation of its own. Nothing half-stored
    either way, one record per prefix."""
    text = "race: the same first message"
    async with httpx.AsyncClient(base_url=gw, headers=AUTH, timeout=60) as http:
        fake_openai.reply_next = {"role": "assistant", "content": "raced"}
        replies = await asyncio.gather(*(http.post("/v1/chat/completions", json=chat(user(text)))
                                         for _ in range(6)))
        answered = [r for r in replies if r.status_code == 200]
        assert answered and all(r.status_code in (200, 409) for r in replies), [r.text for r in replies]
        for r in replies:
            if r.status_code == 409:
                assert r.json()["error"]["code"] == "conversation_busy"
        conversations = {r.headers["x-ctx-conversation-id"] for r in answered}
        for cid in conversations:
            path = await path_of(http, cid)
            assert [m["role"] for m in path][:1] == ["user"] and text in json.dumps(path[0])
    owners = [rec for cid in conversations for rec in await prefix_records(stack, cid) if rec["index"] == 1]
    assert len(owners) == 1  # one conversation owns the prefix; the others hold their messages without it


async def test_large_messages_are_stored_by_reference_new_or_continued(gw, fake_openai, stack):
    """A message over 16 KiB is stored by content reference first; a continuation's is stored only after its
    admission (a 409 stores nothing), then with the command in one commit. Both read back whole."""
    big1, big2 = "first " + "a" * 20_000, "second " + "b" * 20_000
    async with httpx.AsyncClient(base_url=gw, headers=AUTH, timeout=60) as http:
        fake_openai.reply_next = {"role": "assistant", "content": "got it"}
        r = await http.post("/v1/chat/completions", json=chat(user(big1)))
        assert r.status_code == 200, r.text
        cid = r.headers["x-ctx-conversation-id"]
        fake_openai.reply_next = {"role": "assistant", "content": "got that too"}
        r2 = await http.post("/v1/chat/completions", json=chat(
            user(big1), {"role": "assistant", "content": "got it"}, user(big2)))
        assert r2.status_code == 200 and r2.headers["x-ctx-conversation-id"] == cid
        tid2 = r2.headers["x-ctx-turn-id"]
        path = await path_of(http, cid)
    assert [(m["role"], m["parts"][0]["text"]) for m in path] == [
        ("user", big1), ("assistant", "got it"), ("user", big2), ("assistant", "got that too")]
    assert [m["content"] for m in fake_openai.requests[-1]["messages"] if m["role"] == "user"] == [big1, big2]
    rows = await events_of(stack, f"conversation:{cid}", f"turn:{tid2}")
    queued = next(r for r in rows if r["stream_id"] == f"turn:{tid2}" and r["type"] == "TurnQueued")
    assert [r["type"] for r in rows if r["tx"] == queued["tx"]] == ["UserMessageAdded", "TurnQueued"]
