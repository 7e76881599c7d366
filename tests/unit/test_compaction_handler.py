"""The handler around the pure domain: history in, a contract-valid reply out, summarizer failures contained."""

from __future__ import annotations

from ctxbuild_compaction.handlers import turn_start
from ctxbuild_platform import contracts

from tests.unit.test_compaction_domain import REPORT, history, long_history


class FakeHistory:
    def __init__(self, hist):
        self.hist = hist
        self.calls = []

    async def history(self, conversation_id, anchor_id=None):
        self.calls.append((conversation_id, anchor_id))
        return self.hist


def request(**settings):
    req = {"conversationId": "conv-1", "anchorId": "u3", "settings": settings}
    contracts.validate("subjects/ctx.compact.turn_start.request.json", req)
    return req


async def test_compacted_reply_is_contract_valid():
    port = FakeHistory(history(long_history(), [REPORT]))
    reply = await turn_start(request(contextWindow=4_000), port)
    contracts.validate("subjects/ctx.compact.turn_start.reply.json", reply)
    assert reply["decision"]["status"] == "compacted" and port.calls == [("conv-1", "u3")]


async def test_serve_reply_is_contract_valid():
    reply = await turn_start(request(contextWindow=1_000_000, reservation=None, maxMessages=None),
                             FakeHistory(history(long_history(), [REPORT])))
    contracts.validate("subjects/ctx.compact.turn_start.reply.json", reply)
    assert reply["decision"]["status"] == "serve" and reply["messages"] == long_history()


async def test_summarizer_crash_serves_effective_history():
    def broken(fold):
        raise RuntimeError("model unavailable")

    reply = await turn_start(request(contextWindow=4_000), FakeHistory(history(long_history(), [REPORT])),
                             summarizer=broken)
    contracts.validate("subjects/ctx.compact.turn_start.reply.json", reply)
    assert reply["decision"]["status"] == "skipped" and reply["decision"]["reason"] == "summarizer-error"
    assert reply["messages"] == long_history()
