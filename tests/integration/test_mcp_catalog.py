"""MCP catalog over the real stack: the service process, NATS request/reply and a real MCP server over stdio
(mcp-server-time, run by the service with its own interpreter)."""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import datetime

import httpx
import pytest
from ctxbuild_platform.errors import RemoteError

pytestmark = pytest.mark.integration

TIME_SERVER = {"id": "time", "name": "time", "transport": "stdio", "command": sys.executable,
               "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"]}
# the same server, not in the auto pool, so nothing prewarms it: its cache is cold until a resolve needs it
COLD_SERVER = {**TIME_SERVER, "id": "time_cold", "name": "time cold", "active": False}
SLOW_SERVER = {**TIME_SERVER, "id": "time_slow", "name": "time slow", "active": False}
# a server whose process exits at once: it must be reported as an error, never as "no tools"
BROKEN_SERVER = {"id": "broken", "name": "broken", "transport": "stdio", "command": sys.executable,
                 "args": ["-c", "import sys; sys.exit(3)"], "active": False}


@pytest.fixture(scope="module")
def mcp_catalog(stack, start_service) -> str:
    # the session's stack may already run the service with the default servers (e2e): restart it with ours,
    # a superset of the default (same "time" server), so later tests are unaffected
    if stack.alive("mcp_catalog"):
        stack.stop("mcp_catalog")
    return start_service("mcp_catalog",
                         CTX_MCP_SERVERS=json.dumps([TIME_SERVER, COLD_SERVER, SLOW_SERVER, BROKEN_SERVER]))


async def resolve(rpc, **payload):
    return await rpc.call("ctx.mcp.resolve", payload, timeout=40)


async def server_status(base_url: str) -> dict[str, dict]:
    async with httpx.AsyncClient() as http:
        resp = await http.get(f"{base_url}/mcp/servers")
    resp.raise_for_status()
    return {s["id"]: s for s in resp.json()["servers"]}


async def test_resolve_on_a_cold_cache_awaits_the_warm_up(mcp_catalog, rpc, stack):
    assert (await server_status(mcp_catalog))["time_cold"]["status"] == "cold"  # really cold
    # two concurrent turns on the cold server share one warm-up and both get the tools, never []
    first, second = await asyncio.gather(resolve(rpc, serverIds=["time_cold"]),
                                         resolve(rpc, serverIds=["time_cold"]))
    for r in (first, second):
        assert r["servers"] == [{"id": "time_cold", "status": "ready"}]
        assert sorted(t["name"] for t in r["tools"]) == ["convert_time", "get_current_time"]
    assert first["tools"] == second["tools"]  # deterministic
    tools = {t["name"]: t for t in first["tools"]}
    gct = tools["get_current_time"]
    assert gct["serverId"] == "time_cold"
    assert gct["id"].startswith("mcp__time_cold__get_current_time_") and len(gct["id"]) <= 63
    assert gct["inputSchema"]["type"] == "object" and "timezone" in gct["inputSchema"]["properties"]
    assert (await server_status(mcp_catalog))["time_cold"] == {"id": "time_cold", "status": "ready", "tools": 2,
                                                              "active": False}
    # single flight: the two concurrent resolves opened one session
    opened = [json.loads(line) for line in (stack.logs / "mcp_catalog.log").read_text().splitlines()
              if '"mcp-session-open"' in line]
    assert [e["server"] for e in opened].count("time_cold") == 1


async def test_a_server_not_ready_within_the_bound_is_reported_warming(mcp_catalog, rpc):
    assert (await server_status(mcp_catalog))["time_slow"]["status"] == "cold"
    # no time to warm: the reply says so (finding #6: never a silent empty list)
    r = await resolve(rpc, serverIds=["time_slow"], warmTimeoutS=0)
    assert r == {"mode": "manual", "tools": [], "servers": [{"id": "time_slow", "status": "warming"}]}
    # the next turn joins that warm-up and gets the tools
    r = await resolve(rpc, serverIds=["time_slow"])
    assert r["servers"] == [{"id": "time_slow", "status": "ready"}] and len(r["tools"]) == 2


async def test_resolve_the_prewarmed_server(mcp_catalog, rpc):
    r = await resolve(rpc, serverIds=["time"])
    assert r["servers"] == [{"id": "time", "status": "ready"}]
    names = {t["name"]: t["id"] for t in r["tools"]}
    assert sorted(names) == ["convert_time", "get_current_time"]
    assert names["get_current_time"] == "mcp__time__get_current_time_8b5af4dc05e3a09e2e3c"


async def test_invoke_get_current_time(mcp_catalog, rpc):
    r = await resolve(rpc, serverIds=["time"])
    tid = next(t["id"] for t in r["tools"] if t["name"] == "get_current_time")
    out = await rpc.call("ctx.mcp.invoke", {"toolId": tid, "arguments": {"timezone": "UTC"}, "callId": "call-1"})
    output = out["output"]
    assert output["type"] == "content"
    text = next(b["text"] for b in output["value"] if b["type"] == "text")
    data = json.loads(text)
    assert data["timezone"] == "UTC"
    assert datetime.fromisoformat(data["datetime"]).utcoffset().total_seconds() == 0


async def test_tool_reported_error_is_error_text(mcp_catalog, rpc):
    r = await resolve(rpc, serverIds=["time"])
    tid = next(t["id"] for t in r["tools"] if t["name"] == "get_current_time")
    out = await rpc.call("ctx.mcp.invoke", {"toolId": tid, "arguments": {"timezone": "Not/AZone"}})
    assert out["output"]["type"] == "error-text"
    assert "Not/AZone" in out["output"]["value"]


async def test_unknown_tool_is_not_found(mcp_catalog, rpc):
    with pytest.raises(RemoteError) as exc:
        await rpc.call("ctx.mcp.invoke", {"toolId": "mcp__time__no_such_tool_0123456789abcdef0123",
                                          "arguments": {}})
    assert exc.value.code == "not-found" and not exc.value.retryable


async def test_modes(mcp_catalog, rpc):
    disabled = await resolve(rpc, mode="disabled", serverIds=["time"])
    assert disabled == {"mode": "disabled", "tools": [], "servers": []}
    manual_unlinked = await resolve(rpc, mode="manual")
    assert manual_unlinked == {"mode": "manual", "tools": [], "servers": []}
    assert (await resolve(rpc))["mode"] == "manual"  # the one default, defined in the catalog
    auto = await resolve(rpc, mode="auto")  # every active server: time (broken is inactive)
    assert auto["servers"] == [{"id": "time", "status": "ready"}]
    assert len(auto["tools"]) == 2


async def test_not_ready_servers_are_reported(mcp_catalog, rpc):
    r = await resolve(rpc, serverIds=["time", "broken", "ghost"], warmTimeoutS=20)
    by_id = {s["id"]: s for s in r["servers"]}
    assert [s["id"] for s in r["servers"]] == ["time", "broken", "ghost"]
    assert by_id["time"]["status"] == "ready"
    assert by_id["broken"]["status"] == "error" and by_id["broken"]["error"]
    assert by_id["ghost"]["status"] == "error" and "not registered" in by_id["ghost"]["error"]
    assert {t["serverId"] for t in r["tools"]} == {"time"}


@pytest.mark.parametrize("subject,payload", [
    ("ctx.mcp.resolve", {"mode": "sometimes"}),
    ("ctx.mcp.resolve", {"serverIds": "time"}),
    ("ctx.mcp.resolve", {"unexpected": 1}),
    ("ctx.mcp.invoke", {"toolId": "x"}),  # arguments missing
    ("ctx.mcp.invoke", {"toolId": "x", "arguments": []}),
])
async def test_bad_payload_is_invalid_payload(mcp_catalog, rpc, subject, payload):
    with pytest.raises(RemoteError) as exc:
        await rpc.call(subject, payload)
    assert exc.value.code == "invalid-payload"


async def test_readiness_and_status_route(mcp_catalog, rpc):
    await resolve(rpc, serverIds=["time"])
    async with httpx.AsyncClient() as http:
        ready = await http.get(f"{mcp_catalog}/readyz")
    assert ready.status_code == 200, ready.text
    servers = await server_status(mcp_catalog)
    assert servers["time"] == {"id": "time", "status": "ready", "tools": 2, "active": True}
