"""The runner's compaction calls ask for heartbeats, so a compaction replica that died with the request costs the
liveness window (then the in-process fit), not CTX_COMPACTION_TIMEOUT_S."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from ctxbuild_orchestration.app.runner import COMPACTION_HEARTBEAT_S, TurnRunner
from ctxbuild_orchestration.settings import Settings
from ctxbuild_platform.errors import RemoteError


class Refusing:
    """An RpcClient stand-in: records each call and answers it with ``error``."""

    def __init__(self, error: RemoteError) -> None:
        self.error = error
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def call(self, subject: str, payload: dict[str, Any], **kw: Any) -> dict[str, Any]:
        self.calls.append((subject, kw))
        raise self.error


def runner(rpc: Refusing, **kw: Any) -> TurnRunner:
    async def make_provider(_spec, _cid, _tid):
        return SimpleNamespace(name="replay", model="replay")

    return TurnRunner(SimpleNamespace(rpc=rpc), make_provider, **kw)


SILENT = RemoteError("ctx.compact.in_loop", "unavailable", "the responder went silent (no progress for 6 s)", True)


async def test_in_loop_asks_for_heartbeats_and_falls_back_on_silence():
    rpc = Refusing(SILENT)
    full = [{"id": "u1", "role": "user", "parts": [{"type": "text", "text": "hi"}]}]
    served, checkpoint = await runner(rpc, compaction_heartbeat_s=1.5)._in_loop(
        "c1", "t1", 2, full, None, {}, 0, {"summarizer": "llm"}, ts=None)
    assert rpc.calls == [("ctx.compact.in_loop", {"timeout": 120.0, "heartbeat_s": 1.5})]
    assert (served, checkpoint) == (full, None)  # the candidate as it is: compaction's silence is no failure


async def test_turn_start_asks_for_heartbeats():
    rpc = Refusing(RemoteError("ctx.compact.turn_start", "invalid-payload", "refused", False))
    st = SimpleNamespace(turn_id="t1", command={"conversationId": "c1", "userMessageId": "u1",
                                                "provider": {"kind": "replay"},
                                                "settings": {"summarizer": "extractive"}})
    with pytest.raises(RemoteError):  # not transient: raised at once, after the one compaction call
        await runner(rpc)._steps(st, ts=None)
    # the runner's own read of the window (refused here too) sends the turn start on to compaction
    assert rpc.calls == [("ctx.persist.history", {}),
                         ("ctx.compact.turn_start", {"timeout": 45.0, "heartbeat_s": COMPACTION_HEARTBEAT_S})]


def test_the_setting_defaults_to_the_runners_heartbeat():
    assert Settings.model_fields["compaction_heartbeat_s"].default == COMPACTION_HEARTBEAT_S
