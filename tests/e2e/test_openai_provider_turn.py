"""A turn on the OpenAI-compatible adapter, through the services, against a local wire-format server."""

from __future__ import annotations

import json

import httpx
import pytest
from httpx_sse import aconnect_sse

from tests.support.auth import AUTH

pytestmark = pytest.mark.e2e


async def test_turn_with_a_real_adapter(all_services, fake_openai):
    async with httpx.AsyncClient(base_url=all_services, headers=AUTH, timeout=60) as http:
        cid = (await http.post("/v1/conversations", json={"settings": {"contextWindow": 16000,
                                                                        "mcpMode": "disabled"}})).json()["id"]
        await http.post(f"/v1/conversations/{cid}/attachments",
                        files={"file": ("notes.txt", ("hello wire\n" * 300).encode(), "text/plain")})
        turn = (await http.post(f"/v1/conversations/{cid}/turns", json={
            "text": "What is in notes.txt? (read_file handle: notes.txt)",
            "provider": {"kind": "openai", "model": "fake-model"}})).json()
        seen = []
        async with aconnect_sse(http, "GET", turn["events"]) as sse:
            async for ev in sse.aiter_sse():
                seen.append(ev.event)
                if ev.event in ("TurnCompleted", "TurnFailed"):
                    last = json.loads(ev.data)
                    break
        assert seen[-1] == "TurnCompleted", last
        hist = (await http.get(f"/v1/conversations/{cid}/messages")).json()
    wire = [r for r in fake_openai.requests if r["model"] == "fake-model"][-1]
    tool_msgs = [m for m in wire["messages"] if m["role"] == "tool"]
    assert len(tool_msgs) == 1 and tool_msgs[0]["content"].startswith("hello wire\n")
    assert "[Showing 500 of 3300 chars. Call read_file again with offset=500 for more.]" in tool_msgs[0]["content"]
    final = hist["messages"][-1]
    assert final["role"] == "assistant"
    assert final["parts"] == [{"type": "text", "text": f"I read {len(tool_msgs[0]['content'])} characters."}]
    assert final["usage"]["cacheReadTokens"] > 0
    # read_file (an attachment exists), fs_read (it can offload), web_fetch (on by default in a deployment)
    assert {t["function"]["name"] for t in wire["tools"]} == {"read_file", "fs_read", "web_fetch"}


async def test_unconfigured_provider_is_a_typed_error(all_services):
    async with httpx.AsyncClient(base_url=all_services, headers=AUTH, timeout=30) as http:
        cid = (await http.post("/v1/conversations", json={})).json()["id"]
        bad = await http.post(f"/v1/conversations/{cid}/turns", json={"text": "hi", "provider": {"kind": "nope"}})
        assert bad.status_code == 422


async def test_the_answer_streams_as_text_deltas(all_services, fake_openai):
    """A streamed model answer reaches the SSE client as TextDelta events while the step runs; joined, they are the
    answer the turn records. They set no id of their own (live only): a resumed stream replays events, not deltas."""
    answer = "Streaming reaches the front end piece by piece, then the recorded answer."
    async with httpx.AsyncClient(base_url=all_services, headers=AUTH, timeout=60) as http:
        cid = (await http.post("/v1/conversations", json={"settings": {"mcpMode": "disabled",
                                                                        "webTools": False}})).json()["id"]
        fake_openai.reply_next = {"role": "assistant", "content": answer}
        fake_openai.delay_next_s = 1.5  # the model thinks long enough for the client to be listening
        turn = (await http.post(f"/v1/conversations/{cid}/turns", json={
            "text": "say something", "provider": {"kind": "openai", "model": "fake-model"}})).json()
        deltas, order = [], []
        async with aconnect_sse(http, "GET", turn["events"]) as sse:
            async for ev in sse.aiter_sse():
                order.append(ev.event)
                if ev.event == "TextDelta":
                    deltas.append(json.loads(ev.data))
                if ev.event in ("TurnCompleted", "TurnFailed"):
                    last = json.loads(ev.data)
                    break
    assert order[-1] == "TurnCompleted", last
    assert len(deltas) >= 3 and [d["seq"] for d in deltas] == list(range(len(deltas)))
    assert all(d["turnId"] == turn["turnId"] and d["step"] == 1 for d in deltas)
    assert "".join(d["text"] for d in deltas) == answer == last["answer"]
    assert order.index("TextDelta") < order.index("StepServed")  # live: before the step is recorded
    # a conversation that turned web tools off is offered none (nothing to read either: no tools at all)
    wire = [r for r in fake_openai.requests if r["model"] == "fake-model"][-1]
    assert not any(t["function"]["name"].startswith("web_") for t in wire.get("tools") or [])
