"""The handlers around the pure domain: contract-valid replies, the summary stored once at its boundary and
served to later turns (write once, serve many), summarizer failures contained, aborts propagated."""

from __future__ import annotations

import asyncio
import copy

import pytest
from ctxbuild_codec import trim_persist, vfs_uri
from ctxbuild_codec.turn_start.summary_row import with_opening
from ctxbuild_compaction.app import Compaction, Summarizers, in_loop, turn_start
from ctxbuild_compaction.app.summarizers import Choice
from ctxbuild_compaction.domain import FoldOutcome, stored_text, summary_row
from ctxbuild_compaction.handlers import Handlers
from ctxbuild_platform import contracts
from ctxbuild_platform.errors import RemoteError

from tests.support.compaction import typed, untimed
from tests.unit.test_compaction_domain import REPORT, SHA_B, history, long_history


class FakeHistory:
    """Persistence as compaction sees it: summaries stored by boundary (the first one wins) show up as
    ``compactionSummary`` on later history reads; turn streams hold InLoopFoldRecorded events."""

    def __init__(self, hist, *, fail_store=False):
        self.hist = hist
        self.calls = []
        self.summaries: dict[str, dict] = {}
        self.stores = 0
        self.fail_store = fail_store
        self.turns: dict[str, list[dict]] = {}

    async def history(self, conversation_id, anchor_id=None, *, max_messages=None):
        self.calls.append((conversation_id, anchor_id))
        h = copy.deepcopy(self.hist)
        for m in h["messages"]:
            if m["id"] in self.summaries:
                m["compactionSummary"] = self.summaries[m["id"]]["summary"]
        return h

    async def store_summary(self, conversation_id, data):
        self.stores += 1
        if self.fail_store:
            raise RemoteError("ctx.persist.append", "unavailable", "down", True)
        contracts.validate("events/CompactionSummaryRecorded.json", data)
        if data["boundaryId"] in self.summaries:
            return False
        self.summaries[data["boundaryId"]] = data
        return True

    async def last_fold(self, turn_id):
        folds = [e for e in self.turns.get(turn_id, []) if e["type"] == "InLoopFoldRecorded"]
        return folds[-1]["data"] if folds else None


class Counting:
    """A summarizer that counts its calls and what it was given."""

    name = "counting"

    def __init__(self, text="- User: asked for a review of the report."):
        self.text = text
        self.calls = []

    async def fold(self, request):
        self.calls.append(request)
        return FoldOutcome(self.name, summary=self.text, input_tokens=len(request.rows))


def request(**settings):
    req = {"conversationId": "conv-1", "anchorId": "u3", "turnId": "turn-9", "settings": settings}
    contracts.validate("subjects/ctx.compact.turn_start.request.json", req)
    return req


def valid(reply, subject="ctx.compact.turn_start"):
    contracts.validate(f"subjects/{subject}.reply.json", reply)
    return reply


# ---------- turn start ----------

async def test_compacted_reply_is_contract_valid_and_vectors_hold():
    port = FakeHistory(history(long_history(), [REPORT]))
    reply = valid(await turn_start(request(contextWindow=4_000), port))
    d = reply["decision"]
    assert d["status"] == "compacted" and port.calls[0] == ("conv-1", "u3")
    assert (d["trigger"], d["keepBudget"]) == (3_200, 1_200)
    assert d["summarizer"] == "extractive" and d["summarizerCalls"] == 0 and d["stored"] is True
    assert d["startedAt"] <= d["completedAt"] and d["durationMs"] >= 0


async def test_the_typed_handler_answers_what_the_use_case_answers():
    direct = await turn_start(request(contextWindow=4_000), FakeHistory(history(long_history(), [REPORT])))
    handler = Handlers(Compaction(FakeHistory(history(long_history(), [REPORT])))).compact_turn_start
    served = await typed("ctx.compact.turn_start", handler, request(contextWindow=4_000))
    assert served["decision"]["status"] == "compacted" and untimed(served) == untimed(direct)


async def test_summary_is_stored_once_and_served_many():
    port = FakeHistory(history(long_history(), [REPORT]))
    counting = Counting()
    first = valid(await turn_start(request(contextWindow=4_000), port, counting))
    assert first["decision"]["stored"] is True and len(counting.calls) == 1
    assert list(port.summaries) == ["a2"]
    stored = port.summaries["a2"]
    # the fold took the conversation's first request (u1) away: the row keeps its words ahead of the summary
    opening = long_history()[0]["parts"][0]["text"]
    text = with_opening(counting.text, opening)
    assert stored["summary"] == stored_text(text, ["report.pdf"], [])
    assert stored["turnId"] == "turn-9" and stored["foldedCount"] == 4

    # the next turn, with a larger window: the stored summary is served, no summarizer call, nothing stored
    later = valid(await turn_start(request(contextWindow=100_000), port, counting))
    assert len(counting.calls) == 1 and port.stores == 1
    assert later["decision"]["status"] == "serve"
    assert later["messages"][0] == first["messages"][0] == summary_row("a2", text, ["report.pdf"], [])

    # a later attachment does not change the stored summary row's bytes
    port.hist["attachments"].append({**REPORT, "sha256": SHA_B, "handle": "late.csv", "displayName": "late.csv"})
    again = valid(await turn_start(request(contextWindow=100_000), port, counting))
    assert again["messages"][0] == first["messages"][0]
    assert [a["handle"] for a in again["retained"]["fileAttachments"]] == ["report.pdf", "late.csv"]


async def test_a_boundary_stored_first_by_another_turn_wins():
    port = FakeHistory(history(long_history(), [REPORT]))
    port.summaries["a2"] = {"boundaryId": "a2", "summary": "- stored by another replica"}
    # the projection has not caught up on the first read: this turn folds and tries to store
    first_read = port.history

    async def stale(cid, anchor=None, *, max_messages=None):
        port.history = first_read
        h = copy.deepcopy(port.hist)
        return h

    port.history = stale
    reply = valid(await turn_start(request(contextWindow=4_000), port, Counting("- mine")))
    assert reply["decision"]["stored"] is False and reply["decision"]["reused"] is True
    assert "- stored by another replica" in reply["messages"][0]["parts"][0]["text"]


async def test_store_failure_still_serves_the_fold():
    port = FakeHistory(history(long_history(), [REPORT]), fail_store=True)
    reply = valid(await turn_start(request(contextWindow=4_000), port))
    assert reply["decision"]["status"] == "compacted" and reply["decision"]["stored"] is False


async def test_serve_reply_is_contract_valid():
    reply = valid(await turn_start(request(contextWindow=1_000_000, reservation=None, maxMessages=None),
                                   FakeHistory(history(long_history(), [REPORT]))))
    assert reply["decision"]["status"] == "serve" and reply["messages"] == long_history()


class Broken:
    name = "llm"

    async def fold(self, request):
        raise RuntimeError("model unavailable")


def with_put(summarizer, uri="context://vfs/vfs_00000000000000aa.txt"):
    """Summarizers whose masking fallback archives into a fake blob store."""
    puts = []

    async def put(text, conversation_id, turn_id):
        puts.append((len(text), conversation_id, turn_id))
        return uri

    s = Summarizers(put=put)
    s.pick = lambda settings: Choice(summarizer, s.masking)
    return s, puts


async def test_summarizer_crash_falls_back_to_masking_and_reports_skipped():
    port = FakeHistory(history(long_history(), [REPORT]))
    summarizers, puts = with_put(Broken())
    reply = valid(await turn_start(request(contextWindow=4_000), port, summarizers))
    d = reply["decision"]
    assert d["status"] == "skipped" and d["reason"] == "summarizer-error"
    assert d["fallback"] == "masking" and d["failedSummarizer"] == "llm" and "model unavailable" in d["error"]
    assert port.stores == 0  # masking is not a text summary: nothing is stored
    served = reply["messages"]
    assert [m["id"] for m in served] == [m["id"] for m in long_history()]
    # the folded web_search output (6,000 chars, not archived yet) was archived for the turn, then masked
    assert puts == [(6_000, "conv-1", "turn-9")]
    t1 = next(m for m in served if m["id"] == "t1")["parts"][0]
    assert t1["output"]["value"] == ("<persisted-output>\noutput truncated (1 lines, 6000 chars total; preview "
                                     "omitted)\nFull output: context://vfs/vfs_00000000000000aa.txt\nRead the full "
                                     "content with the fs_read tool (pass the URI above; page with offset/limit)."
                                     "\n</persisted-output>")
    assert t1["offload"]["uri"] == "context://vfs/vfs_00000000000000aa.txt"
    assert d["postTokens"] < d["estimatedTokens"]


async def test_llm_unavailable_uses_the_offline_summarizer():
    port = FakeHistory(history(long_history(), [REPORT]))
    reply = valid(await turn_start(request(contextWindow=4_000, summarizer="llm", provider="replay"), port,
                                   Summarizers(provider_for=lambda kind, model: None)))
    assert reply["decision"]["summarizer"] == "extractive" and reply["decision"]["note"] == "llm-unavailable"


async def test_persisted_outputs_are_served_rendered():
    text = "".join(f"line {i} of a long tool output\n" for i in range(400))
    part = {"type": "tool-result", "toolCallId": "c9", "toolName": "web_fetch",
            "output": {"type": "text", "value": text}}
    stored = trim_persist(part, 2_000, lambda blob: vfs_uri(blob.sha256))
    assert stored["output"]["type"] == "persisted"
    rows = [*long_history()[:2], {"id": "t1", "role": "tool", "parts": [
        {**stored, "toolCallId": "c1", "toolName": "web_search"}]}, *long_history()[3:]]
    reply = valid(await turn_start(request(contextWindow=1_000_000), FakeHistory(history(rows, [REPORT]))))
    out = reply["messages"][2]["parts"][0]
    assert out["output"]["type"] == "text" and "<persisted-output>" in out["output"]["value"]
    assert out["offload"]["mode"] == "offloaded"


# ---------- in loop ----------

def loop_request(messages, checkpoint=..., **settings):
    req = {"conversationId": "conv-1", "turnId": "turn-1", "step": 3, "offset": 0, "messages": messages,
           "fixedTokens": 100, "retained": {"fileAttachments": [{"handle": "report.pdf"}], "persistedUris": []},
           "settings": {"contextWindow": 4_000, **settings}}
    if checkpoint is not ...:
        req["checkpoint"] = checkpoint
    contracts.validate("subjects/ctx.compact.in_loop.request.json", req)
    return req


async def test_in_loop_fits_means_zero_summarizer_calls():
    counting = Counting()
    reply = valid(await in_loop(loop_request(long_history()[4:], None), FakeHistory(history([])), counting),
                  "ctx.compact.in_loop")
    assert reply["decision"]["status"] == "serve" and reply["decision"]["summarizerCalls"] == 0
    assert counting.calls == [] and reply["checkpointChanged"] is False
    assert reply["messages"] == long_history()[4:]


async def test_in_loop_folds_and_a_resumed_turn_reads_the_checkpoint_back():
    port = FakeHistory(history([]))
    counting = Counting()
    rows = long_history()
    first = valid(await in_loop(loop_request(rows, None), port, counting), "ctx.compact.in_loop")
    d = first["decision"]
    assert d["status"] == "compacted" and first["checkpointChanged"] and len(counting.calls) == 1
    ck = first["checkpoint"]
    assert ck["consumedCount"] == 4 and ck["compactedPrefix"][0]["id"] == "compaction:a2"
    assert "read_file tool: report.pdf]" in ck["compactedPrefix"][0]["parts"][0]["text"]
    # what the runner records on the turn stream, read back by a replica that resumes the turn
    port.turns["turn-1"] = [{"type": "TurnStarted", "data": {}},
                            {"type": "InLoopFoldRecorded", "data": {"turnId": "turn-1", **ck}}]
    contracts.validate("events/InLoopFoldRecorded.json", port.turns["turn-1"][1]["data"])
    resumed = valid(await in_loop(loop_request(rows), port, counting), "ctx.compact.in_loop")
    assert resumed["decision"]["checkpointReadBack"] is True
    assert resumed["messages"] == first["messages"] and len(counting.calls) == 1  # no refold
    # the runner passes its own checkpoint and only the messages it has not consumed
    tail = valid(await in_loop({**loop_request(rows[4:], ck), "offset": 4}, port, counting), "ctx.compact.in_loop")
    assert tail["messages"] == first["messages"] and tail["checkpoint"] == ck


async def test_in_loop_messages_before_the_checkpoint_are_a_typed_error():
    from ctxbuild_platform.errors import InvalidPayload
    ck = {"consumedCount": 2, "compactedPrefix": []}
    with pytest.raises(InvalidPayload):
        await in_loop({**loop_request(long_history()[5:], ck), "offset": 5}, FakeHistory(history([])))


async def test_in_loop_summarizer_failure_falls_back_to_masking():
    summarizers, puts = with_put(Broken())
    reply = valid(await in_loop(loop_request(long_history(), None), FakeHistory(history([])), summarizers),
                  "ctx.compact.in_loop")
    assert puts == [(6_000, "conv-1", "turn-1")]
    d = reply["decision"]
    assert d["status"] == "skipped" and d["fallback"] == "masking" and d["reason"] == "summarizer-error"
    assert reply["checkpointChanged"] is True and reply["checkpoint"]["summarizer"] == "masking"


async def test_in_loop_abort_propagates():
    class Slow:
        name = "llm"

        async def fold(self, request):
            raise asyncio.CancelledError()

    with pytest.raises(asyncio.CancelledError):
        await in_loop(loop_request(long_history(), None), FakeHistory(history([])), Slow())
    with pytest.raises(asyncio.CancelledError):
        await turn_start(request(contextWindow=4_000), FakeHistory(history(long_history(), [REPORT])), Slow())
