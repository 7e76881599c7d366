"""A step's tool events are appended together (issue #21 item 2): the runner records all of a step's
ToolCallRequested events in one append before the first call runs and all its ToolResultRecorded events in one
append — one Postgres transaction each (the same ``tx`` on every row) — with the usual stable event ids, so the
turn still reads back each call and result once, in order."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.support.auth import AUTH

pytestmark = pytest.mark.e2e


def run_turn(base: str, script: list[dict]) -> tuple[str, list[dict]]:
    cid = httpx.post(f"{base}/v1/conversations", headers=AUTH, json={"title": "batched"}, timeout=30).json()["id"]
    r = httpx.post(f"{base}/v1/conversations/{cid}/turns", headers=AUTH, timeout=30,
                   json={"text": "read three", "provider": {"kind": "replay", "script": script}})
    assert r.status_code == 202, r.text
    tid = r.json()["turnId"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        evs = httpx.get(f"{base}/v1/conversations/{cid}/turns/{tid}", headers=AUTH, timeout=30).json()["events"]
        if any(e["type"] in ("TurnCompleted", "TurnFailed") for e in evs):
            return tid, evs
        time.sleep(0.1)
    raise AssertionError("the turn did not end")


async def test_a_steps_calls_and_results_are_one_append_each(all_services, pg):
    calls = [{"toolName": "fs_read", "input": {"uri": f"missing-{k}"}} for k in range(3)]
    tid, evs = run_turn(all_services, [{"toolCalls": calls}, {"text": "done"}])
    assert [e["type"] for e in evs if e["type"] in ("TurnCompleted", "TurnFailed")] == ["TurnCompleted"]
    types = [e["type"] for e in evs if e["type"] in ("ToolCallRequested", "ToolResultRecorded")]
    assert types == ["ToolCallRequested"] * 3 + ["ToolResultRecorded"] * 3
    rows = await pg.fetch("SELECT type, tx::text AS tx, version FROM persistence.events WHERE stream_id = $1 "
                          "AND type IN ('ToolCallRequested', 'ToolResultRecorded') ORDER BY version", f"turn:{tid}")
    by_type: dict[str, set[str]] = {}
    for r in rows:
        by_type.setdefault(r["type"], set()).add(r["tx"])
    assert len(rows) == 6 and all(len(txs) == 1 for txs in by_type.values()), rows  # one transaction per kind
    assert by_type["ToolCallRequested"] != by_type["ToolResultRecorded"]
    versions = [r["version"] for r in rows]
    assert versions == list(range(versions[0], versions[0] + 6))
