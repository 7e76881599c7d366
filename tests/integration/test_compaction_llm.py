"""The ``llm`` summarizer end to end over the wire: turn-start compaction through the real OpenAI-compatible
adapter (``ctxbuild_providers``) against a local chat-completions server, the summary stored in the real event
store. (The session's compaction service has no model endpoint configured, so the handler runs in-process here
with the service's own adapters.)"""

from __future__ import annotations

import pytest
from ctxbuild_codec import summarizer_budgets
from ctxbuild_compaction.adapters.persistence import History
from ctxbuild_compaction.adapters.providers import make_provider
from ctxbuild_compaction.app import Summarizers, in_loop, turn_start
from ctxbuild_compaction.domain.llm_input import INSTRUCTION, SYSTEM
from ctxbuild_compaction.settings import Settings
from ctxbuild_devstack import free_port

from tests.integration.test_compaction import seed_conversation
from tests.support.fake_openai import FakeOpenAI
from tests.support.server import serving

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def services(start_service):
    start_service("persistence")


@pytest.fixture(scope="module")
def model():
    yield from serving(FakeOpenAI(free_port()))


def summarizers(model) -> Summarizers:
    settings = Settings(nats_url="nats://127.0.0.1:4222", openai_base_url=model.base_url)
    return Summarizers("llm", provider_for=lambda kind, name: make_provider(kind, name, settings))


async def test_turn_start_folds_with_the_llm_and_stores_once(services, rpc, model):
    cid = await seed_conversation(rpc)
    history = History(rpc, 15)
    req = {"conversationId": cid, "turnId": "turn-3",
           "settings": {"contextWindow": 4_000, "provider": "openai", "model": "gpt-test", "summarizerWindow": 128_000}}
    before = len(model.requests)
    reply = await turn_start(req, history, summarizers(model))
    d = reply["decision"]
    assert d["status"] == "compacted" and d["summarizer"] == "llm" and d["summarizerCalls"] == 1 and d["stored"]
    (wire,) = model.requests[before:]
    assert wire["model"] == "gpt-test" and "tools" not in wire
    assert wire["max_tokens"] == summarizer_budgets(128_000, 4_000)[0] == 16_384
    assert d["summarizerInputTokens"] > 0
    assert wire["messages"][0] == {"role": "system", "content": SYSTEM}
    assert wire["messages"][-1] == {"role": "user", "content": INSTRUCTION}
    flat = [m["content"] for m in wire["messages"][1:-1]]
    assert flat[0].startswith("Please review the attached report.") and flat[0].endswith("[document: report.pdf]")
    assert flat[1].endswith('[Called tool: web_search({"q":"report"})]')
    assert flat[2].startswith("[Tool result (c1): lorem")
    # the fake model answers "I read 0 characters." — post-processed, stored once, served from then on
    assert "I read 0 characters." in reply["messages"][0]["parts"][0]["text"]
    again = await turn_start(req, history, summarizers(model))
    assert again["decision"]["status"] == "serve" and len(model.requests) == before + 1
    assert again["messages"][0] == reply["messages"][0]


async def test_model_failure_falls_back_to_masking_in_loop(services, rpc, model):
    msgs = [{"id": "u1", "role": "user", "parts": [{"type": "text", "text": "go"}]}]
    for i in range(1, 13):
        msgs += [{"id": f"a{i}", "role": "assistant", "turnId": "t", "parts": [
                     {"type": "tool-call", "toolCallId": f"c{i}", "toolName": "read_file", "input": {"p": i}}]},
                 {"id": f"t{i}", "role": "tool", "turnId": "t", "parts": [
                     {"type": "tool-result", "toolCallId": f"c{i}", "toolName": "read_file",
                      "output": {"type": "text", "value": "small " * 400}}]}]
    model.fail_next = 400  # not retried by the SDK: the summarizer fails
    reply = await in_loop({"conversationId": "conv-x", "turnId": "t", "messages": msgs, "checkpoint": None,
                           "settings": {"contextWindow": 4_000, "provider": "openai", "model": "gpt-test"}},
                          History(rpc, 15), summarizers(model))
    d = reply["decision"]
    assert d["status"] == "skipped" and d["fallback"] == "masking" and d["failedSummarizer"] == "llm"
    assert "HTTP 400" in d["error"] and reply["checkpointChanged"]
