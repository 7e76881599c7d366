"""Two catalog replicas (two processes, one queue group) sharing the NATS KV tool cache: a cold server is warmed
once across both (KV lease), the replica that did not warm serves the list from KV, and a restart of both on
a cold cache resolves exactly as before (deterministic, never warming / never empty)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import nats
import pytest
from ctxbuild_devstack.replica import Replica as DevReplica

pytestmark = pytest.mark.integration

TIME_SERVER = {"id": "time", "name": "time", "transport": "stdio", "command": sys.executable,
               "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"]}
LEASE_SERVER = {**TIME_SERVER, "id": "time_lease", "name": "time lease", "active": False}
GIT_SERVER = {"id": "git_rep", "name": "git", "transport": "stdio", "command": sys.executable,
              "args": ["-m", "mcp_server_git"], "active": False}
SERVERS = json.dumps([TIME_SERVER, LEASE_SERVER, GIT_SERVER])


def Replica(stack, name: str):
    """A second catalog process on the stack's env with this test's servers (its own port and log)."""
    return DevReplica(stack, "mcp_catalog", name, CTX_MCP_SERVERS=SERVERS, CTX_REPLICA_ID=name).wait_ready()


def listed(log: Path, server: str) -> int:
    n = 0
    for line in log.read_text().splitlines():
        if '"mcp-tools-listed"' in line and json.loads(line).get("server") == server:
            n += 1
    return n


def servers_of(url: str) -> dict[str, dict]:
    return {s["id"]: s for s in httpx.get(f"{url}/mcp/servers", timeout=5).json()["servers"]}


@pytest.fixture(scope="module")
def two_replicas(stack, start_service):
    if stack.alive("mcp_catalog"):
        stack.stop("mcp_catalog")
    a_url = start_service("mcp_catalog", CTX_MCP_SERVERS=SERVERS, CTX_REPLICA_ID="replica-a")
    replicas = {"a": a_url, "a_log": Path(stack.logs) / "mcp_catalog.log", "b": Replica(stack, "mcp_catalog_b")}
    yield replicas
    replicas["b"].stop()  # a test may have replaced the second replica: stop the current one


async def resolve(rpc, **payload):
    return await rpc.call("ctx.mcp.resolve", payload, timeout=40)


async def test_a_cold_server_is_warmed_once_across_replicas(two_replicas, rpc):
    a_url, a_log, b = two_replicas["a"], two_replicas["a_log"], two_replicas["b"]
    assert servers_of(a_url)["time_lease"]["status"] == "cold"
    assert servers_of(b.url)["time_lease"]["status"] == "cold"
    # twelve concurrent turns, spread over both replicas by the queue group
    replies = await asyncio.gather(*(resolve(rpc, serverIds=["time_lease"]) for _ in range(12)))
    for r in replies:
        assert r["servers"] == [{"id": "time_lease", "status": "ready"}] and len(r["tools"]) == 2
        assert r == replies[0]
    assert listed(a_log, "time_lease") + listed(b.log, "time_lease") == 1  # one tools/list in the cluster
    # both replicas see the server ready: one listed it, the other serves the shared KV entry
    assert servers_of(a_url)["time_lease"]["status"] == "ready"
    assert servers_of(b.url)["time_lease"]["status"] == "ready"
    # and either replica invokes it (opening its own session)
    tid = next(t["id"] for t in replies[0]["tools"] if t["name"] == "get_current_time")
    outs = await asyncio.gather(*(rpc.call("ctx.mcp.invoke", {"toolId": tid, "arguments": {"timezone": "UTC"}})
                                  for _ in range(6)))
    assert all(o["output"]["type"] == "content" for o in outs)


async def test_cold_cache_restart_resolves_deterministically(two_replicas, rpc, stack, start_service):
    payload = {"serverIds": ["time", "git_rep"], "dialect": "anthropic", "contextWindow": 8_000}
    before = await resolve(rpc, **payload)
    assert [s["status"] for s in before["servers"]] == ["ready", "ready"]
    assert before["deferral"]["deferred"] is True and len(before["tools"]) == 14
    legacy_before = await resolve(rpc, serverIds=["time", "git_rep"])

    # stop every replica, lose the whole tool cache, start again
    b = two_replicas["b"]
    b.stop()
    stack.stop("mcp_catalog")
    nc = await nats.connect(stack.env["CTX_NATS_URL"])
    try:
        await nc.jetstream().purge_stream("KV_ctx_mcp_tools")
    finally:
        await nc.close()
    start_service("mcp_catalog", CTX_MCP_SERVERS=SERVERS, CTX_REPLICA_ID="replica-a")
    two_replicas["b"] = Replica(stack, "mcp_catalog_b2")

    # the first turns after the restart await the warm-up: same tools, same wire, same decision
    after = await asyncio.gather(*(resolve(rpc, **payload) for _ in range(4)))
    for r in after:
        assert json.dumps(r, sort_keys=True) == json.dumps(before, sort_keys=True)
    assert await resolve(rpc, serverIds=["time", "git_rep"]) == legacy_before
