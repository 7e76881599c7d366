"""The drop-in gateway's server side on the real stack (SPEC §15.5): /v1/chat/completions and /v1/messages over
the durable turn path, the upstream being the local wire-format servers of tests/support. Conversation identity
(implicit by prefix, explicit, forks), client tools handed over and continued, ctxbuild's own tools run
server-side, response headers, errors in each dialect's shape. (The real SDKs and frameworks against it:
tests/e2e/test_gateway_clients*.py.)"""

from __future__ import annotations

import httpx
import pytest

from tests.support.auth import AUTH

pytestmark = pytest.mark.e2e

MODEL = "fake-model"  # not in the model table: served on the request dialect's upstream (passthrough)


def chat(*messages: dict, **extra) -> dict:
    return {"model": MODEL, "messages": list(messages), **extra}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


async def messages_of(http: httpx.AsyncClient, cid: str) -> list[dict]:
    return (await http.get(f"/v1/conversations/{cid}/messages")).json()["messages"]


async def test_a_plain_request_then_its_continuation(all_services, fake_openai):
    """No tools: one turn per request; the follow-up (the answer resent + a new question) continues the same
    conversation under the answer; headers name the conversation, the turn, served tokens and overhead."""
    async with httpx.AsyncClient(base_url=all_services, headers=AUTH, timeout=60) as http:
        fake_openai.reply_next = {"role": "assistant", "content": "Paris."}
        r = await http.post("/v1/chat/completions", json=chat(
            {"role": "system", "content": "Be brief."}, user("Capital of France?")))
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] == "Paris."
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"]["prompt_tokens"] > 0 and body["usage"]["completion_tokens"] == 12
        cid, tid = r.headers["x-ctx-conversation-id"], r.headers["x-ctx-turn-id"]
        assert tid.startswith("turn_") and int(r.headers["x-ctx-served-tokens"]) > 0
        assert float(r.headers["x-ctx-overhead-ms"]) >= 0
        upstream = fake_openai.requests[-1]
        # the client's system prompt is served after ctxbuild's own; no tools offered for a plain chat
        assert upstream["messages"][0]["role"] == "system" and upstream["messages"][0]["content"].endswith(
            "\n\nBe brief.")
        assert not upstream.get("tools")

        fake_openai.reply_next = {"role": "assistant", "content": "About 2.1 million."}
        r2 = await http.post("/v1/chat/completions", json=chat(
            {"role": "system", "content": "Be brief."}, user("Capital of France?"),
            {"role": "assistant", "content": "Paris."}, user("Population?")))
        assert r2.status_code == 200, r2.text
        assert r2.headers["x-ctx-conversation-id"] == cid and r2.headers["x-ctx-turn-id"] != tid
        path = await messages_of(http, cid)
    assert [(m["role"], m["parts"][0]["text"]) for m in path] == [
        ("user", "Capital of France?"), ("assistant", "Paris."), ("user", "Population?"),
        ("assistant", "About 2.1 million.")]
    # the served history: the stored conversation, not a second copy of the resent answer
    served = [m["content"] for m in fake_openai.requests[-1]["messages"] if m["role"] != "system"]
    assert served == ["Capital of France?", "Paris.", "Population?"]
