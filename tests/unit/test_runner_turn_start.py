"""The runner plans a turn start itself when nothing needs folding (issue #19): the turn-start window read from
persistence, planned by the compaction service's own code (ctxbuild_codec.turn_start), served without a
ctx.compact.turn_start call; a fold (or a window it cannot read) still goes to the compaction service.

The RpcClient stand-in answers ``ctx.persist.history`` in byte-bounded pages as persistence does (newest first,
``nextAnchorId`` = the parent of the page's first row) and ``ctx.compact.turn_start`` with the compaction service's
use case over the same history, so "what compaction would answer" is compaction's code, not a copy of it."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
from ctxbuild_compaction.adapters.persistence import History
from ctxbuild_compaction.app import turn_start
from ctxbuild_orchestration.app.runner import TurnRunner
from ctxbuild_orchestration.settings import Settings
from ctxbuild_platform.errors import RemoteError

from tests.support.compaction import TIMING
from tests.unit.test_compaction_domain import assistant, filler, long_history, user

PAGE_ROWS = 3  # a small page, so every window here spans several pages
WINDOW = {"contextWindow": 4_000, "reservation": None, "compressEnabled": True, "summarizer": "extractive",
          "provider": "replay", "model": "replay"}


def chained(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**r, "parentId": rows[i - 1]["id"] if i else None} for i, r in enumerate(rows)]


class Services:
    """Persistence (history pages, appends) and compaction (its turn_start use case) behind one ``call``; every
    call is recorded by subject. ``down``: subjects answered with that error instead."""

    def __init__(self, rows: list[dict[str, Any]], down: dict[str, RemoteError] | None = None) -> None:
        self.rows = chained(rows)
        self.down = down or {}
        self.calls: list[str] = []
        self.stored: list[dict[str, Any]] = []

    async def call(self, subject: str, payload: dict[str, Any], **kw: Any) -> dict[str, Any]:
        self.calls.append(subject)
        if subject in self.down:
            raise self.down[subject]
        if subject == "ctx.persist.history":
            return self.page(payload)
        if subject == "ctx.persist.append":
            self.stored.extend(payload["events"])
            return {"duplicates": []}
        if subject == "ctx.compact.turn_start":
            return await turn_start(payload, History(self, 10.0))
        raise AssertionError(f"unexpected call {subject}")

    def page(self, payload: dict[str, Any]) -> dict[str, Any]:
        anchor, limit = payload.get("anchorId"), payload.get("maxMessages")
        upto = next(i for i, r in enumerate(self.rows) if r["id"] == anchor) + 1 if anchor else len(self.rows)
        take = min(PAGE_ROWS, limit or PAGE_ROWS)
        page = copy.deepcopy(self.rows[max(0, upto - take): upto])
        out = {"conversationId": "conv-1", "messages": page, "attachments": [], "persistedUris": [], "start": "root"}
        if upto > take and (not limit or limit > take):
            out.update(start="page", more=True, nextAnchorId=page[0]["parentId"])
        elif upto > take:
            out["start"] = "limit"
        return out


def runner(services: Services, **kw: Any) -> TurnRunner:
    async def make_provider(_spec, _cid, _tid):
        return SimpleNamespace(name="replay", model="replay")

    return TurnRunner(SimpleNamespace(rpc=services, patience_s=0.0), make_provider, **kw)


def short_history() -> list[dict[str, Any]]:
    return [user("u1", "hello " + filler(50)), assistant("a1", "hi " + filler(50)),
            user("u2", "and more " + filler(50)), assistant("a2", "sure " + filler(50)), user("u3", "thanks")]


def untimed(reply: dict[str, Any]) -> dict[str, Any]:
    return {**reply, "decision": {k: v for k, v in reply["decision"].items() if k not in TIMING}}


async def start_of(services: Services, anchor: str, **kw: Any) -> dict[str, Any]:
    return await runner(services, **kw)._turn_start("conv-1", anchor, "turn-1", {}, WINDOW)


async def test_nothing_to_fold_is_planned_here_as_compaction_would():
    services = Services(short_history())
    start = await start_of(services, "u3")
    assert services.calls == ["ctx.persist.history"] * 2  # two pages, and no compaction call
    expected = await turn_start({"conversationId": "conv-1", "anchorId": "u3", "turnId": "turn-1",
                                 "settings": {**WINDOW, "maxMessages": None}}, History(Services(short_history()), 10))
    assert untimed(start) == untimed(expected)
    assert start["decision"]["status"] == "serve" and start["decision"]["reason"] == "under-trigger"
    assert [m["id"] for m in start["messages"]] == ["u1", "a1", "u2", "a2", "u3"]
    assert set(TIMING) <= set(start["decision"])  # CompactionDecided carries the same timing as compaction's


async def test_a_created_conversations_carried_window_is_planned_without_a_read():
    """A first attempt whose work message carried the messages its command's commit created the conversation with
    plans from them (no ctx.persist.history call) exactly as from the read; messages for another anchor, or a
    maxMessages window, are read as before; a hint is taken once."""
    rows = [user("u1", "a question " + filler(40)), user("u2", "and another one")]
    services = Services(rows)
    r = runner(services)
    r._windows["turn-1"] = chained(rows)
    carried = await r._turn_start("conv-1", "u2", "turn-1", {}, WINDOW)
    assert services.calls == []
    read = await start_of(Services(rows), "u2")
    assert untimed(carried) == untimed(read)
    assert [m["id"] for m in carried["messages"]] == ["u1", "u2"] and carried["decision"]["status"] == "serve"
    assert "turn-1" not in r._windows
    r._windows["turn-1"] = chained(rows)[:1]  # not the turn's anchor: read
    await r._turn_start("conv-1", "u2", "turn-1", {}, WINDOW)
    assert services.calls == ["ctx.persist.history"]
    r._windows["turn-1"] = chained(rows)  # a maxMessages window is cut by persistence: read
    await r._turn_start("conv-1", "u2", "turn-1", {"maxMessages": 1}, {**WINDOW, "maxMessages": 1})
    assert services.calls == ["ctx.persist.history"] * 2


async def test_a_fold_goes_to_the_compaction_service():
    services = Services(long_history())
    start = await start_of(services, "u3")
    assert "ctx.compact.turn_start" in services.calls
    assert services.calls[0] == "ctx.persist.history"  # planned here first: it needs a summary
    assert start["decision"]["status"] == "compacted" and start["messages"][0]["id"].startswith("compaction:")
    assert [e["type"] for e in services.stored] == ["CompactionSummaryRecorded"]


async def test_max_messages_pages_like_compaction():
    services = Services(short_history())
    start = await runner(services)._turn_start("conv-1", "u3", "turn-1", {"maxMessages": 4},
                                               {**WINDOW, "maxMessages": 4})
    assert "ctx.compact.turn_start" not in services.calls
    expected = await turn_start({"conversationId": "conv-1", "anchorId": "u3", "turnId": "turn-1",
                                 "settings": {**WINDOW, "maxMessages": 4}}, History(Services(short_history()), 10))
    assert untimed(start) == untimed(expected)


@pytest.mark.parametrize("error", [RemoteError("ctx.persist.history", "unavailable", "down", True),
                                   RemoteError("ctx.persist.history", "not-found", "no such anchor", False)])
async def test_a_history_read_that_fails_here_asks_compaction_as_before(error):
    services = Services(short_history(), down={"ctx.persist.history": error})
    unavailable = RemoteError("ctx.compact.turn_start", "unavailable", "no responders", True)
    with pytest.raises(RemoteError) as raised:
        await start_of(services, "u3")
    # compaction reads the same history and meets the same error: what the turn got before this change
    assert services.calls[:2] == ["ctx.persist.history", "ctx.compact.turn_start"]
    assert raised.value.code == error.code
    services.down["ctx.compact.turn_start"] = unavailable
    services.calls.clear()
    if error.retryable:
        with pytest.raises(RemoteError):  # compaction away too: the in-process fallback reads (and fails) again
            await start_of(services, "u3")
        assert services.calls == ["ctx.persist.history", "ctx.compact.turn_start", "ctx.persist.history"]


async def test_off_every_turn_start_asks_compaction():
    services = Services(short_history())
    start = await start_of(services, "u3", local_turn_start_plan=False)
    assert services.calls[0] == "ctx.compact.turn_start"
    assert start["decision"]["status"] == "serve"
    assert Settings.model_fields["turn_start_local_plan"].default is True
