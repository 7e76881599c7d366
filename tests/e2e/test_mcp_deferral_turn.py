"""A turn whose MCP tools are deferred (SPEC §11) through the whole stack: the runner resolves with the provider's
dialect, the window and the turn id; the request offers the meta-tools and the <deferred-tools> block instead of
the server's tools; tool_search → tool_inspect → tool_invoke run through ctx.mcp.meta and the inner tool (a real
mcp-server-git) really runs, recorded under its effectiveToolName."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
from ctxbuild_mcp_catalog.domain.tool_ids import tool_id

from tests.support.auth import AUTH

pytestmark = pytest.mark.e2e


def wait_terminal(base: str, cid: str, tid: str, timeout: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        evs = httpx.get(f"{base}/v1/conversations/{cid}/turns/{tid}", headers=AUTH, timeout=30).json()["events"]
        if any(e["type"] in ("TurnCompleted", "TurnFailed") for e in evs):
            return evs
        time.sleep(0.2)
    raise AssertionError("turn did not end")


async def test_deferred_git_tools_run_through_the_meta_tools(all_services, rpc, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "notes.txt").write_text("untracked work\n")
    server = {"id": "git_defer", "name": "git", "transport": "stdio", "command": sys.executable,
              "args": ["-m", "mcp_server_git", "--repository", str(repo)]}
    reply = await rpc.call("ctx.mcp.servers.upsert", {"server": server})
    assert reply["server"]["id"] == "git_defer"
    status_id = tool_id("git_defer", "git_status", "git")
    try:
        await run_deferred_turn(all_services, repo, status_id)
    finally:  # the registry is shared by the session: leave it as found (other tests list the active servers)
        await rpc.call("ctx.mcp.servers.remove", {"id": "git_defer"})


async def run_deferred_turn(base: str, repo, status_id: str) -> None:
    cid = httpx.post(f"{base}/v1/conversations", headers=AUTH, timeout=30, json={
        "settings": {"contextWindow": 6000, "mcpServers": ["git_defer"]}}).json()["id"]
    script = [{"toolCalls": [{"toolName": "tool_search", "input": {"query": "working tree status"}}]},
              {"toolCalls": [{"toolName": "tool_inspect", "input": {"name": status_id}}]},
              {"toolCalls": [{"toolName": "tool_invoke", "input": {"name": status_id,
                                                                   "params": {"repo_path": str(repo)}}}]},
              {"text": "one untracked file"}]
    r = httpx.post(f"{base}/v1/conversations/{cid}/turns", headers=AUTH, timeout=30,
                   json={"text": "what is the git status?", "provider": {"kind": "replay", "script": script}})
    assert r.status_code == 202, r.text
    tid = r.json()["turnId"]
    evs = wait_terminal(base, cid, tid)
    ends = [e for e in evs if e["type"] in ("TurnCompleted", "TurnFailed")]
    assert ends[0]["type"] == "TurnCompleted", ends

    req = httpx.get(f"{base}/v1/conversations/{cid}/turns/{tid}/steps/1/request", headers=AUTH, timeout=30).json()
    names = {t["name"] for t in req["tools"]}
    assert {"tool_search", "tool_inspect", "tool_invoke"} <= names
    assert not any(n.startswith("mcp__git_defer__") for n in names), names  # deferred: not on the wire
    assert "<deferred-tools>" in req["system"] and "git" in req["system"]

    results = {e["data"]["step"]: e["data"] for e in evs if e["type"] == "ToolResultRecorded"}
    search = results[1]["output"]
    assert status_id in json.dumps(search)  # the ranked search finds git_status
    assert "inputSchema" in json.dumps(results[2]["output"]) or "repo_path" in json.dumps(results[2]["output"])
    invoked = results[3]
    assert invoked["effectiveToolName"] == status_id
    text = json.dumps(invoked["output"])
    assert "notes.txt" in text and "[Error" not in text
