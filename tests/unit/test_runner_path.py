"""The runner's local decisions on its critical path agree with the services they stand in for."""

from __future__ import annotations

import json

import pytest
from ctxbuild_compaction.domain.in_loop import Checkpoint, InLoopSettings, plan_in_loop
from ctxbuild_orchestration.app.runner import nothing_to_fold


def _messages(n: int, size: int) -> list[dict]:
    out = []
    for i in range(n):
        role = "user" if i % 2 == 0 else "assistant"
        out.append({"id": f"m{i}", "role": role, "parts": [{"type": "text", "text": f"word{i} " * size}]})
    return out


@pytest.mark.parametrize("window", [None, 2000, 8000, 32000])
@pytest.mark.parametrize("n,size", [(1, 5), (4, 200), (12, 300), (40, 400)])
@pytest.mark.parametrize("fixed", [0, 900])
@pytest.mark.parametrize("compress", [True, False])
def test_first_step_skip_matches_compaction_plan(window, n, size, fixed, compress):
    """Step 1 without a checkpoint: the runner skips ctx.compact.in_loop exactly when the service's plan would
    serve the candidate unchanged (no fold), with the same budget and token counter."""
    served = _messages(n, size)
    settings = {"contextWindow": window, "reservation": None, "compressEnabled": compress}
    plan = plan_in_loop(served, 0, Checkpoint.from_payload(None),
                        InLoopSettings.from_payload({"settings": settings, "fixedTokens": fixed}), turn_id="t1")
    assert nothing_to_fold(served, fixed, settings) == (plan.fold is None)
    if nothing_to_fold(served, fixed, settings):
        assert plan.served == served and plan.decision["status"] == "serve"


def test_some_cases_fold():
    """The grid above holds both outcomes (a skip that is always taken would prove nothing)."""
    settings = {"contextWindow": 2000, "compressEnabled": True}
    assert not nothing_to_fold(_messages(40, 400), 0, settings)
    assert nothing_to_fold(_messages(1, 5), 0, settings)


def test_a_turn_command_may_carry_its_queued_data():
    """ctx.turn.run: the old message ({turnId, conversationId}) still parses (no hint: the runner reads the stream);
    a message with ``command`` hands the recorded TurnQueued data to the first attempt as it was recorded."""
    from ctxbuild_orchestration.adapters.work_queue import Delivery, turn_command

    old = Delivery(turn_command(json.dumps({"turnId": "t1", "conversationId": "c1"}).encode()), 1, None)
    assert old.turn_id == "t1" and old.queued is None
    data = {"turnId": "t1", "conversationId": "c1", "userMessageId": "u1", "provider": {"kind": "replay",
            "script": [{"text": "hi"}]}, "settings": {"contextWindow": 8000}, "trace": {}}
    new = Delivery(turn_command(json.dumps({"turnId": "t1", "conversationId": "c1", "command": data}).encode()),
                   1, None)
    assert new.queued == data


def test_a_command_that_is_not_a_turn_command_is_refused():
    from ctxbuild_orchestration.adapters.work_queue import turn_command
    from ctxbuild_platform.errors import InvalidPayload

    with pytest.raises(InvalidPayload):
        turn_command(json.dumps({"turnId": "t1", "conversationId": "c1", "command": {"turnId": "t1"}}).encode())
