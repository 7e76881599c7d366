"""Helpers of the attack tests (tests/security): drive turns through the HTTP edge with the replay provider (the
model's decisions are the attacker's script) and read back everything a turn stored."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
from ctxbuild_devstack import SERVICES

from tests.support.auth import AUTH


def uid() -> str:
    return uuid.uuid4().hex


def secret_lines(marker: str, n: int = 4000) -> str:
    """An attachment far over a 16k window's threshold: read_file's page of it is offloaded in flight."""
    return "\n".join(f"{marker} line {i}: " + "x" * 80 for i in range(n))


@dataclass
class Turn:
    conversation: str
    id: str
    events: list[dict[str, Any]]

    @property
    def end(self) -> dict[str, Any]:
        return next(e for e in self.events if e["type"] in ("TurnCompleted", "TurnFailed"))

    def outputs(self, step: int = 1) -> list[dict[str, Any]]:
        """The recorded outputs of a step's tool calls, in the order the script made the calls."""
        calls = [e["data"]["toolCallId"] for e in self.events
                 if e["type"] == "ToolCallRequested" and e["data"]["step"] == step]
        results = {e["data"]["toolCallId"]: e["data"] for e in self.events
                   if e["type"] == "ToolResultRecorded" and e["data"]["step"] == step}
        return [results[c] for c in calls]


class Edge:
    """The orchestration HTTP API of one edge."""

    def __init__(self, base: str, headers: dict[str, str] | None = None) -> None:
        self.base = base
        self.headers = AUTH if headers is None else headers  # default: the session's tenant key

    def conversation(self, **settings: Any) -> str:
        r = httpx.post(f"{self.base}/v1/conversations", headers=self.headers, json={"settings": settings}, timeout=30)
        assert r.status_code in (200, 201), r.text
        return r.json()["id"]

    def attach(self, cid: str, name: str, text: str) -> dict[str, Any]:
        r = httpx.post(f"{self.base}/v1/conversations/{cid}/attachments", headers=self.headers, timeout=60,
                       files={"file": (name, text.encode(), "text/plain")})
        assert r.status_code in (200, 201), r.text
        return r.json()

    def turn(self, cid: str, script: list[dict[str, Any]], text: str = "go",
             tools: list[dict[str, Any]] | None = None) -> Turn:
        provider = {"kind": "replay", "script": script, **({"tools": tools} if tools else {})}
        r = httpx.post(f"{self.base}/v1/conversations/{cid}/turns", headers=self.headers, timeout=30,
                       json={"text": text, "provider": provider})
        assert r.status_code == 202, r.text
        return self.wait(cid, r.json()["turnId"])

    def regenerate(self, cid: str, turn_id: str, script: list[dict[str, Any]]) -> Turn:
        r = httpx.post(f"{self.base}/v1/conversations/{cid}/turns/{turn_id}/regenerate", headers=self.headers,
                       timeout=30, json={"provider": {"kind": "replay", "script": script}})
        assert r.status_code == 202, r.text
        return self.wait(cid, r.json()["turnId"])

    def wait(self, cid: str, turn_id: str, timeout: float = 180) -> Turn:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            evs = httpx.get(f"{self.base}/v1/conversations/{cid}/turns/{turn_id}", headers=self.headers,
                            timeout=30).json()["events"]
            if any(e["type"] in ("TurnCompleted", "TurnFailed") for e in evs):
                return Turn(cid, turn_id, evs)
            time.sleep(0.1)
        raise AssertionError(f"turn {turn_id} did not end")

    def messages(self, cid: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.base}/v1/conversations/{cid}/messages", headers=self.headers, params={"branches": "true"},
                      timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["messages"]

    def stored(self, turn: Turn) -> str:
        """Everything stored for the attacker's turn: its events, its messages, every request the model saw."""
        steps = [e["data"]["step"] for e in turn.events if e["type"] == "StepServed"]
        requests = [httpx.get(f"{self.base}/v1/conversations/{turn.conversation}/turns/{turn.id}/steps/{s}/request",
                              headers=self.headers, timeout=30).text for s in steps]
        mine = [m for m in self.messages(turn.conversation) if m.get("turnId") == turn.id]
        return json.dumps({"events": turn.events, "messages": mine, "requests": requests}, ensure_ascii=False)


def offloaded_uri(turn: Turn) -> str:
    """The URI of the first tool output the turn offloaded in flight."""
    for e in turn.events:
        if e["type"] == "ToolResultRecorded" and (e["data"].get("offload") or {}).get("uri"):
            return e["data"]["offload"]["uri"]
    raise AssertionError(f"no offloaded output in turn {turn.id}")


def victim_conversation(edge: Edge) -> dict[str, Any]:
    """Conversation A: an attachment full of a secret marker, and an answered turn whose read of it was offloaded
    (an archived output of A). The attacker knows A's ids, handle and URIs — only not the content."""
    marker = "SECRET-" + uid()
    cid = edge.conversation(contextWindow=16000)
    att = edge.attach(cid, "secretA.txt", secret_lines(marker))
    turn = edge.turn(cid, [{"toolCalls": [{"toolName": "read_file",
                                           "input": {"filename": att["handle"], "limit": 60000}}]},
                           {"text": "read"}])
    assert turn.end["type"] == "TurnCompleted", turn.end
    uri = offloaded_uri(turn)
    # the owner reads its own archive: the refusals below are about who asks, not about a broken blob
    own = edge.turn(cid, [{"toolCalls": [{"toolName": "fs_read", "input": {"uri": uri, "limit": 3}}]}, {"text": "ok"}])
    assert marker in own.outputs()[0]["output"]["value"]
    return {"cid": cid, "turn": turn.id, "marker": marker, "handle": att["handle"], "uri": uri,
            "att_uri": f"context://vfs/vfs_{att['sha256'][:16]}.txt", "att_sha": att["sha256"]}


def refusal(out: dict[str, Any]) -> str:
    """The model-facing text of a refused call (an error output)."""
    assert out["output"]["type"] == "error-text", out
    return out["output"]["value"]


async def stream_version(pg, stream: str) -> int:
    """The stream's last version in the event store (0: nothing stored)."""
    return await pg.fetchval("SELECT coalesce(max(version), 0) FROM persistence.events WHERE stream_id = $1", stream)


def start_all(stack, start_service) -> str:
    """The six services as processes on the session's stack (each once per session); the edge's base URL."""
    for name in SERVICES:
        start_service(name)
    return stack.env["CTX_ORCHESTRATION_HTTP"]
