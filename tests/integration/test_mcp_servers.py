"""MCP catalog against real MCP servers: the registry's subjects (Postgres), mcp-server-git over stdio,
@modelcontextprotocol/server-everything over streamable HTTP (content pass-through, timeout, cancellation),
change notifications, and the meta-tools over NATS with a deferred catalog."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import nats
import pytest
from ctxbuild_devstack.stack import free_port
from ctxbuild_platform.errors import RemoteError
from jsonschema import Draft202012Validator

pytestmark = pytest.mark.integration

TIME_SERVER = {"id": "time", "name": "time", "transport": "stdio", "command": sys.executable,
               "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"]}
NPM_CACHE = Path(os.environ.get("CTX_MCP_NPM_CACHE", Path.home() / ".cache" / "ctxbuild-mcp-npm"))
EVERYTHING = "@modelcontextprotocol/server-everything"


@pytest.fixture(scope="module")
def mcp_catalog(stack, start_service) -> str:
    if stack.alive("mcp_catalog"):
        stack.stop("mcp_catalog")
    return start_service("mcp_catalog", CTX_MCP_SERVERS=json.dumps([TIME_SERVER]))


@pytest.fixture(scope="module")
def git_repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("repo")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid"}
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True, env=env)
    (repo / "README.md").write_text("hello\n")
    subprocess.run(["git", "-C", str(repo), "add", "README.md"], check=True, env=env)
    subprocess.run(["git", "-C", str(repo), "commit", "-q", "-m", "first commit from the test"], check=True, env=env)
    return repo


@pytest.fixture(scope="module")
def everything_url(stack):
    """server-everything over streamable HTTP on a free loopback port (npm install into a cache folder)."""
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("npm/node not available: cannot install @modelcontextprotocol/server-everything")
    entry = NPM_CACHE / "node_modules" / "@modelcontextprotocol" / "server-everything" / "dist" / "index.js"
    if not entry.exists():
        NPM_CACHE.mkdir(parents=True, exist_ok=True)
        try:
            done = subprocess.run(["npm", "install", "--prefix", str(NPM_CACHE), "--no-audit", "--no-fund",
                                   EVERYTHING], check=False, capture_output=True, text=True, timeout=240)
        except subprocess.TimeoutExpired:
            pytest.skip("npm install of server-everything timed out")
        if done.returncode != 0 or not entry.exists():
            pytest.skip(f"npm install of server-everything failed: {done.stderr[-300:]}")
    port = free_port()
    log = open(stack.logs / "server-everything.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(["node", str(entry), "streamableHttp"], env={**os.environ, "PORT": str(port)},
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            if proc.poll() is not None:
                pytest.skip("server-everything exited at start")
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


async def call(rpc, subject, payload, timeout=40):
    return await rpc.call(subject, payload, timeout=timeout)


async def upsert(rpc, server):
    return await call(rpc, "ctx.mcp.servers.upsert", {"server": server})


# ---------- registry ----------
async def test_registry_crud_and_status(mcp_catalog, rpc):
    srv = {**TIME_SERVER, "id": "time_crud", "name": "time crud", "active": False, "env": {"API_KEY": "s3cret"}}
    created = await upsert(rpc, srv)
    assert created["created"] is True and created["server"]["status"] == "cold"
    assert created["server"]["source"] == "api" and created["server"]["env"] == {"API_KEY": "<redacted>"}
    r = await call(rpc, "ctx.mcp.resolve", {"serverIds": ["time_crud"]})
    assert r["servers"] == [{"id": "time_crud", "status": "ready"}] and len(r["tools"]) == 2
    listed = {s["id"]: s for s in (await call(rpc, "ctx.mcp.servers.list", {}))["servers"]}
    assert listed["time_crud"]["status"] == "ready" and listed["time_crud"]["toolCount"] == 2
    assert listed["time"]["source"] == "env"
    again = await upsert(rpc, {**srv, "enabled": False})
    assert again["created"] is False and again["server"]["revision"] == created["server"]["revision"] + 1
    assert again["server"]["status"] == "disabled"
    r = await call(rpc, "ctx.mcp.resolve", {"serverIds": ["time_crud"]})
    assert r == {"mode": "manual", "tools": [], "servers": [{"id": "time_crud", "status": "disabled"}]}
    assert await call(rpc, "ctx.mcp.servers.remove", {"id": "time_crud"}) == {"removed": True}
    assert await call(rpc, "ctx.mcp.servers.remove", {"id": "time_crud"}) == {"removed": False}
    r = await call(rpc, "ctx.mcp.resolve", {"serverIds": ["time_crud"]})
    assert r["servers"] == [{"id": "time_crud", "status": "error", "error": "MCP server is not registered"}]
    with pytest.raises(RemoteError) as exc:
        await upsert(rpc, {"id": "nocmd", "transport": "stdio"})
    assert exc.value.code == "invalid-payload"
    with pytest.raises(RemoteError) as exc:
        await upsert(rpc, {"id": "x", "transport": "http", "url": "ftp://nope"})
    assert exc.value.code == "invalid-payload"


# ---------- stdio: mcp-server-git ----------
async def test_git_server_over_stdio(mcp_catalog, rpc, git_repo):
    await upsert(rpc, {"id": "git", "name": "git", "command": sys.executable,
                       "args": ["-m", "mcp_server_git", "--repository", str(git_repo)], "active": False})
    try:
        r = await call(rpc, "ctx.mcp.resolve", {"serverIds": ["git"]})
        assert r["servers"] == [{"id": "git", "status": "ready"}]
        tools = {t["name"]: t["id"] for t in r["tools"]}
        assert {"git_status", "git_log", "git_diff_unstaged", "git_commit"} <= set(tools)
        status = await call(rpc, "ctx.mcp.invoke", {"toolId": tools["git_status"],
                                                    "arguments": {"repo_path": str(git_repo)}, "callId": "g1"})
        text = status["output"]["value"][0]["text"]
        assert status["output"]["type"] == "content" and "main" in text
        log = await call(rpc, "ctx.mcp.invoke", {"toolId": tools["git_log"],
                                                 "arguments": {"repo_path": str(git_repo), "max_count": 1}})
        assert "first commit from the test" in log["output"]["value"][0]["text"]
        # an OpenAI-strict model sends null for an optional argument: taken back before the call
        log2 = await call(rpc, "ctx.mcp.invoke", {"toolId": tools["git_log"], "arguments": {
            "repo_path": str(git_repo), "max_count": None, "start_timestamp": None, "end_timestamp": None}})
        assert "first commit from the test" in log2["output"]["value"][0]["text"]
    finally:
        await call(rpc, "ctx.mcp.servers.remove", {"id": "git"})


# ---------- streamable HTTP: server-everything ----------
def unclock(value):
    return json.loads(re.sub(r"\d{1,2}:\d{2}:\d{2}( [AP]M)?", "<time>", json.dumps(value)))


async def direct_call(url: str, name: str, args: dict):
    from mcp import Client

    async with Client(url, cache=None) as client:
        return await client.call_tool(name, args)


async def test_everything_over_streamable_http_passes_content_through_intact(mcp_catalog, rpc, everything_url):
    await upsert(rpc, {"id": "everything", "name": "everything", "transport": "http", "url": everything_url,
                       "active": False})
    try:
        r = await call(rpc, "ctx.mcp.resolve", {"serverIds": ["everything"]})
        assert r["servers"] == [{"id": "everything", "status": "ready"}], r["servers"]
        tools = {t["name"]: t["id"] for t in r["tools"]}
        assert {"echo", "get-tiny-image", "get-resource-reference", "get-structured-content"} <= set(tools)

        echo = await call(rpc, "ctx.mcp.invoke", {"toolId": tools["echo"], "arguments": {"message": "hi"}})
        assert echo["output"]["type"] == "content" and "hi" in echo["output"]["value"][0]["text"]

        for name, args in (("get-tiny-image", {}), ("get-resource-reference", {"resourceType": "Text",
                                                                                "resourceId": 1}),
                           ("get-structured-content", {"location": "Chicago"})):
            got = await call(rpc, "ctx.mcp.invoke", {"toolId": tools[name], "arguments": args})
            ref = await direct_call(everything_url, name, args)
            blocks = [b.model_dump(mode="json", by_alias=True, exclude_none=True) for b in ref.content]
            # every block, every field, as the SDK reads it (the dynamic resource text carries its clock time)
            assert unclock(got["output"]["value"]) == unclock(blocks), name
            if ref.structured_content is not None:
                assert got["output"]["metadata"] == {"structuredContent": ref.structured_content}
        image = next(b for b in (await call(rpc, "ctx.mcp.invoke", {"toolId": tools["get-tiny-image"],
                                                                    "arguments": {}}))["output"]["value"]
                     if b["type"] == "image")
        assert image["mimeType"] == "image/png" and len(image["data"]) > 100
        resource = (await call(rpc, "ctx.mcp.invoke", {"toolId": tools["get-resource-reference"],
                                                       "arguments": {"resourceType": "Text", "resourceId": 1}}))
        assert any(b["type"] == "resource" and b["resource"]["uri"] for b in resource["output"]["value"])
    finally:
        await call(rpc, "ctx.mcp.servers.remove", {"id": "everything"})


async def test_invoke_timeout_and_cancellation(mcp_catalog, rpc, stack, everything_url):
    await upsert(rpc, {"id": "everything2", "name": "everything2", "transport": "http", "url": everything_url,
                       "active": False})
    try:
        r = await call(rpc, "ctx.mcp.resolve", {"serverIds": ["everything2"]})
        long_op = next(t["id"] for t in r["tools"] if t["name"] == "trigger-long-running-operation")
        # the call's own timeout answers (a typed timed-out output), not the 10 s operation
        out = await call(rpc, "ctx.mcp.invoke", {"toolId": long_op, "arguments": {"duration": 10, "steps": 5},
                                                 "timeoutS": 1})
        assert out["timedOut"] is True and out["output"]["type"] == "error-text"

        nc = await nats.connect(stack.env["CTX_NATS_URL"])
        try:
            task = asyncio.create_task(call(rpc, "ctx.mcp.invoke", {
                "toolId": long_op, "arguments": {"duration": 10, "steps": 5}, "callId": "call-cancel-me"}))
            await asyncio.sleep(1.0)
            await nc.publish("ctx.mcp.cancel", json.dumps({"callId": "call-cancel-me"}).encode())
            out = await task
            # the cancel ends the call: its answer is the cancelled output, not the operation's
            assert out == {"output": {"type": "error-text", "value": "the call was cancelled"}, "cancelled": True}
            # a call that starts after its cancel (e.g. an inner tool_invoke call) is refused at once
            late = await call(rpc, "ctx.mcp.invoke", {"toolId": long_op, "arguments": {"duration": 10},
                                                      "callId": "call-cancel-me::inner"})
            assert late["cancelled"] is True
        finally:
            await nc.close()
    finally:
        await call(rpc, "ctx.mcp.servers.remove", {"id": "everything2"})


# ---------- change notifications ----------
async def test_tools_changed_is_published_only_on_real_change(mcp_catalog, rpc, stack):
    nc = await nats.connect(stack.env["CTX_NATS_URL"])
    seen: list[dict] = []

    async def on_msg(msg):
        body = json.loads(msg.data)
        if body["serverId"] == "time_notify":
            seen.append(body)

    await nc.subscribe("ctx.mcp.tools_changed", cb=on_msg)
    await nc.flush()
    try:
        await upsert(rpc, {**TIME_SERVER, "id": "time_notify", "name": "time notify", "active": False})
        await call(rpc, "ctx.mcp.resolve", {"serverIds": ["time_notify"]})
        # the cache entry is lost (KV key purged): the next resolve lists the same tools again → no change
        js = nc.jetstream()
        kv = await js.key_value("ctx_mcp_tools")
        from ctxbuild_mcp_catalog.adapters.tool_cache import server_key

        await kv.purge(server_key("time_notify"))
        r = await call(rpc, "ctx.mcp.resolve", {"serverIds": ["time_notify"]})
        assert r["servers"] == [{"id": "time_notify", "status": "ready"}]
        await call(rpc, "ctx.mcp.servers.remove", {"id": "time_notify"})
        for _ in range(50):
            if len(seen) >= 2:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        assert [s["reason"] for s in seen] == ["listed", "removed"]
        assert seen[0]["toolCount"] == 2 and seen[1]["previousFingerprint"] == seen[0]["fingerprint"]
    finally:
        await nc.close()


# ---------- deferral and meta-tools over NATS ----------
async def test_deferred_catalog_and_meta_tools_over_nats(mcp_catalog, rpc, git_repo):
    await upsert(rpc, {"id": "git_meta", "name": "git", "command": sys.executable,
                       "args": ["-m", "mcp_server_git", "--repository", str(git_repo)], "active": False})
    try:
        r = await call(rpc, "ctx.mcp.resolve", {"serverIds": ["time", "git_meta"], "dialect": "anthropic",
                                                "contextWindow": 8_000, "turnId": "turn-meta-1"})
        d = r["deferral"]
        assert d["deferred"] is True and d["threshold"] == 800 and d["autoPoolTools"] == len(r["tools"])
        assert [t["name"] for t in r["wire"]["tools"]] == ["tool_search", "tool_inspect", "tool_invoke"]
        assert r["wire"]["systemPrompt"].splitlines()[2:4] == ["- time: 2 tools", "- git: 12 tools"]
        invoke = r["wire"]["tools"][2]
        # finding #1 on the real wire: the example with params is valid against the final schema
        assert invoke["inputExamples"][0]["params"]
        assert Draft202012Validator(invoke["inputSchema"]).is_valid(invoke["inputExamples"][0])
        gct = next(t["id"] for t in r["tools"] if t["name"] == "get_current_time")

        async def meta(tool, args, call_id=None):
            payload = {"turnId": "turn-meta-1", "tool": tool, "arguments": args}
            if call_id:
                payload["callId"] = call_id
            return await call(rpc, "ctx.mcp.meta", payload)

        found = json.loads((await meta("tool_search", {"query": "current time timezone", "limit": 3}))
                           ["output"]["value"])
        assert found["results"][0]["name"] == gct
        first = await meta("tool_invoke", {"name": gct, "params": {"timezone": "UTC"}}, "outer-1")
        assert first["output"]["type"] == "error-text" and first["inspected"] == [gct]
        assert json.loads(first["output"]["value"].split("\n", 1)[1])["name"] == gct
        bad = await meta("tool_invoke", {"name": gct, "params": {"tz": "UTC"}}, "outer-2")
        assert "timezone" in bad["output"]["value"] and bad["output"]["type"] == "error-text"
        ran = await meta("tool_invoke", {"name": gct, "params": {"timezone": "UTC"}}, "outer-3")
        assert ran["output"]["type"] == "content" and ran["effectiveToolName"] == gct
        assert ran["callId"] == f"outer-3::{gct}"
        assert json.loads(ran["output"]["value"][0]["text"])["timezone"] == "UTC"
        sig = json.loads((await meta("tool_inspect", {"name": gct}))["output"]["value"])
        assert sig["parameters"]["required"] == ["timezone"]
        # the same request for a big window: nothing deferred, the tools go on the wire themselves
        big = await call(rpc, "ctx.mcp.resolve", {"serverIds": ["time", "git_meta"], "dialect": "gemini",
                                                  "contextWindow": 1_000_000})
        assert big["deferral"]["deferred"] is False and big["wire"]["systemPrompt"] is None
        assert len(big["wire"]["tools"]) == len(big["tools"]) == 14
    finally:
        await call(rpc, "ctx.mcp.servers.remove", {"id": "git_meta"})


async def test_status_route_reports_http_errors_as_error(mcp_catalog, rpc):
    port = free_port()  # nothing listens here
    await upsert(rpc, {"id": "dead_http", "transport": "http", "url": f"http://127.0.0.1:{port}/mcp",
                       "active": False})
    try:
        r = await call(rpc, "ctx.mcp.resolve", {"serverIds": ["dead_http"], "warmTimeoutS": 20})
        assert r["servers"][0]["status"] == "error" and r["servers"][0]["error"]
        async with httpx.AsyncClient() as http:
            servers = {s["id"]: s for s in (await http.get(f"{mcp_catalog}/mcp/servers")).json()["servers"]}
        assert servers["dead_http"]["status"] == "error"
    finally:
        await call(rpc, "ctx.mcp.servers.remove", {"id": "dead_http"})


# ---------- a turn's tool call runs at most once ----------
COUNTING = Path(__file__).resolve().parents[1] / "support" / "counting_mcp_server.py"


async def test_a_call_of_a_turn_runs_once_however_often_it_is_asked(mcp_catalog, rpc, tmp_path):
    """A runner that died with a call in flight resumes the turn and asks again: the catalog answers from its
    run ledger (or joins the run in flight) and the tool's side effect happens once per (turn, call)."""
    from tests.support.counting_mcp_server import runs

    ledger = tmp_path / "ledger.txt"
    await upsert(rpc, {"id": "ctr", "name": "counter", "command": sys.executable,
                       "args": [str(COUNTING), str(ledger)], "active": False})
    try:
        r = await call(rpc, "ctx.mcp.resolve", {"serverIds": ["ctr"]})
        stamp = {t["name"]: t["id"] for t in r["tools"]}["stamp"]

        def ask(turn: str | None, call_id: str, key: str, delay_ms: int = 0):
            req = {"toolId": stamp, "arguments": {"key": key, "delay_ms": delay_ms}, "callId": call_id}
            return call(rpc, "ctx.mcp.invoke", {**req, "turnId": turn} if turn else req)

        # two askers at once (the first still running): one run, the same output for both
        first, second = await asyncio.gather(ask("turn-a", "call_1", "k1", 1500), ask("turn-a", "call_1", "k1", 1500))
        assert first == second and "stamped k1" in json.dumps(first)
        # asked again later: the recorded output, no new run
        assert await ask("turn-a", "call_1", "k1") == first
        assert runs(ledger)["k1"] == 1
        # the same call id in another turn (replayed scripts reuse ids) is another call; no turn id: no ledger
        await ask("turn-b", "call_1", "k1")
        await ask(None, "call_1", "k2")
        await ask(None, "call_1", "k2")
        assert runs(ledger) == {"k1": 2, "k2": 2}
    finally:
        await call(rpc, "ctx.mcp.servers.remove", {"id": "ctr"})


async def test_the_run_ledger_keeps_a_large_output_in_the_claim_store(stack):
    from ctxbuild_mcp_catalog.adapters.tool_cache import RUN_INLINE_MAX_BYTES, KvBuckets, KvRunLedger
    from ctxbuild_platform import claims

    nc = await nats.connect(stack.env["CTX_NATS_URL"])
    try:
        buckets = KvBuckets(lambda: nc, tools="CTX_TEST_TOOLS", leases="CTX_TEST_LEASES", turns="CTX_TEST_RUNS",
                            lease_ttl_s=60, turn_ttl_s=600)
        ledger = KvRunLedger(buckets, lambda: claims.store(nc))
        big = {"output": {"type": "text", "value": "x" * (2 * RUN_INLINE_MAX_BYTES)}}
        assert await ledger.begin("run_big", {"replica": "r1"}) is None
        seen = await ledger.begin("run_big", {"replica": "r2"})
        assert seen is not None and seen["state"] == "running" and seen["replica"] == "r1"
        await ledger.finish("run_big", big)
        for _ in range(2):  # shared claim: every re-ask reads it
            entry = await ledger.read("run_big")
            assert entry == {"state": "done", "result": big}
    finally:
        await nc.close()
