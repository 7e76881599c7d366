"""The catalog's coordination logic with in-memory twins of the KV cache, the turn store and the registry:
single flight across replicas, backoff, prewarm concurrency, change notifications only on real change,
resolve with a dialect, and the meta-tools end to end (the MCP session itself is faked here; the integration
tests use real servers)."""

from __future__ import annotations

import asyncio
import json

import mcp_types
import pytest
from ctxbuild_mcp_catalog.adapters.registry import MemoryRegistry
from ctxbuild_mcp_catalog.adapters.tool_cache import InMemoryToolCache, InMemoryTurnStore
from ctxbuild_mcp_catalog.app import Catalog
from ctxbuild_mcp_catalog.settings import McpServerConfig, Settings


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def cfg(sid: str, **kw) -> McpServerConfig:
    return McpServerConfig(id=sid, name=sid, command="/bin/false", **kw)


def mk_tools(names: list[str], desc: str = "") -> list[mcp_types.Tool]:
    return [mcp_types.Tool.model_validate({"name": n, "description": desc or f"{n} tool",
                                           "inputSchema": {"type": "object",
                                                           "properties": {"q": {"type": "string"}},
                                                           "required": ["q"]}}) for n in names]


class World:
    """Shared state of N replicas: one cache, one registry, one turn store; per-replica fake sessions."""

    def __init__(self, servers: list[McpServerConfig]) -> None:
        self.cache = InMemoryToolCache()
        self.registry = MemoryRegistry(servers)
        self.turns = InMemoryTurnStore()
        self.clock = Clock()
        self.lists: dict[str, int] = {}
        self.catalogs: dict[str, list[mcp_types.Tool] | Exception] = {s.id: mk_tools(["a", "b"]) for s in servers}
        self.published: list[dict] = []
        self.delay = 0.05
        self.running = 0
        self.max_running = 0

    def replica(self, name: str) -> Catalog:
        settings = Settings(nats_url="nats://127.0.0.1:4222", database_url="postgresql://u@127.0.0.1/db",
                            mcp_servers=[], replica_id=name, warm_timeout_s=2.0)

        async def publish(payload: dict) -> None:
            self.published.append(payload)

        c = Catalog(settings, self.registry, self.cache, self.turns, publish=publish, clock=self.clock)

        async def list_tools(server: McpServerConfig):
            self.lists[server.id] = self.lists.get(server.id, 0) + 1
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            try:
                await asyncio.sleep(self.delay)
                result = self.catalogs[server.id]
                if isinstance(result, Exception):
                    raise result
                return list(result)
            finally:
                self.running -= 1

        c._list_tools = list_tools  # type: ignore[method-assign]
        return c


async def test_single_flight_across_replicas_and_identical_answers():
    w = World([cfg("s1")])
    a, b = w.replica("A"), w.replica("B")
    replies = await asyncio.gather(*(r.resolve({"serverIds": ["s1"]}) for r in (a, b, a, b, b)))
    assert w.lists == {"s1": 1}  # five concurrent turns on two replicas: one tools/list
    for r in replies:
        assert r["servers"] == [{"id": "s1", "status": "ready"}] and [t["name"] for t in r["tools"]] == ["a", "b"]
    assert all(r == replies[0] for r in replies)
    assert not await w.cache.leased("s1")  # the lease is released


async def test_backoff_after_empty_and_after_failure():
    w = World([cfg("empty"), cfg("bad")])
    w.catalogs["empty"] = []
    w.catalogs["bad"] = RuntimeError("spawn failed")
    c = w.replica("A")
    r = await c.resolve({"serverIds": ["empty", "bad"]})
    assert r["servers"] == [{"id": "empty", "status": "ready"},
                            {"id": "bad", "status": "error", "error": "RuntimeError: spawn failed"}]
    w.clock.now += 29
    await c.resolve({"serverIds": ["empty", "bad"]})
    assert w.lists == {"empty": 1, "bad": 1}  # neither asked again yet
    w.clock.now += 1  # 30 s after the failure
    await c.resolve({"serverIds": ["empty", "bad"]})
    assert w.lists == {"empty": 1, "bad": 2}
    w.clock.now += 270  # 300 s after the empty list
    await c.resolve({"serverIds": ["empty"]})
    assert w.lists["empty"] == 2


async def test_prewarm_three_at_a_time():
    w = World([cfg(f"s{i}") for i in range(7)] + [cfg("inactive", active=False), cfg("off", enabled=False)])
    c = w.replica("A")
    await c.start()
    await asyncio.gather(*c._background)
    assert w.max_running == 3
    assert sorted(w.lists) == [f"s{i}" for i in range(7)]  # inactive and disabled servers are not prewarmed


async def test_change_notifications_only_on_real_change_even_after_cache_loss():
    w = World([cfg("s1")])
    c = w.replica("A")
    await c.resolve({"serverIds": ["s1"]})
    assert [p["reason"] for p in w.published] == ["listed"] and w.published[0]["previousFingerprint"] is None
    await w.cache.mark_stale("s1")  # the server said its list changed, but it is the same list
    served = await c.resolve({"serverIds": ["s1"]})  # the last good list is served while the refresh runs
    assert served["servers"] == [{"id": "s1", "status": "ready"}] and len(served["tools"]) == 2
    await asyncio.gather(*c._warming.values())
    assert w.lists["s1"] == 2 and len(w.published) == 1
    w.cache = InMemoryToolCache()  # the whole cache lost (e.g. KV bucket recreated): same list → no change
    c2 = w.replica("B")
    await c2.resolve({"serverIds": ["s1"]})
    assert w.lists["s1"] == 3 and len(w.published) == 1
    w.catalogs["s1"] = mk_tools(["a", "b", "c"])
    await w.cache.mark_stale("s1")
    await c2.resolve({"serverIds": ["s1"]})
    await asyncio.gather(*c2._warming.values())
    assert len(w.published) == 2 and w.published[1]["toolCount"] == 3
    assert w.published[1]["previousFingerprint"] == w.published[0]["fingerprint"]


async def test_a_config_change_drops_the_cached_list():
    w = World([cfg("s1")])
    c = w.replica("A")
    await c.resolve({"serverIds": ["s1"]})
    await c.upsert_server(cfg("s1", args=["--other"], active=False))
    r = await c.resolve({"serverIds": ["s1"], "warmTimeoutS": 0})
    assert r["servers"] == [{"id": "s1", "status": "warming"}] and r["tools"] == []
    r = await c.resolve({"serverIds": ["s1"]})
    assert r["servers"] == [{"id": "s1", "status": "ready"}] and w.lists["s1"] == 2


async def test_disabled_server_and_disabled_tool():
    w = World([cfg("s1", tools={"b": {"enabled": False}}), cfg("off", enabled=False)])
    c = w.replica("A")
    r = await c.resolve({"serverIds": ["s1", "off"]})
    assert [t["name"] for t in r["tools"]] == ["a"]
    assert r["servers"][1] == {"id": "off", "status": "disabled"} and "off" not in w.lists
    listed = {s["id"]: s for s in (await c.list_servers())["servers"]}
    assert listed["off"]["status"] == "disabled" and listed["s1"]["status"] == "ready"


@pytest.fixture
def deferred_world():
    w = World([cfg("big", tools={"gated": {"approval": "required"}}), cfg("small", defer="never")])
    w.catalogs["big"] = mk_tools([f"tool_{i}" for i in range(8)] + ["gated"], desc="x " * 40)
    w.catalogs["small"] = mk_tools(["keep"])
    return w


async def test_resolve_with_dialect_defers_and_meta_tools_run(deferred_world):
    w = deferred_world
    c = w.replica("A")
    calls = []

    async def fake_call(cfg_, tool, args, call_id, timeout):
        calls.append((tool["name"], args, call_id))
        return {"output": {"type": "content", "value": [{"type": "text", "text": "ran"}]}}

    c._call = fake_call  # type: ignore[method-assign]
    r = await c.resolve({"serverIds": ["big", "small"], "dialect": "anthropic", "contextWindow": 2_000,
                         "turnId": "turn-1"})
    d = r["deferral"]
    assert d["deferred"] and d["threshold"] == 200 and d["reason"] == "auto-pool-deferred"
    names = [t["name"] for t in r["wire"]["tools"]]
    keep_id = next(t["id"] for t in r["tools"] if t["name"] == "keep")
    assert names == [keep_id, "tool_search", "tool_inspect", "tool_invoke"]
    assert "- big: 9 tools" in r["wire"]["systemPrompt"]
    assert all("inputSchema" not in t for t in r["tools"])
    ids = {t["name"]: t["id"] for t in r["tools"]}

    search = await c.meta({"turnId": "turn-1", "tool": "tool_search", "arguments": {"query": "tool 3"}})
    assert json.loads(search["output"]["value"])["results"][0]["name"] == ids["tool_3"]
    # invoke before inspect → the signature, and the name is now inspected
    first = await c.meta({"turnId": "turn-1", "tool": "tool_invoke", "callId": "c1",
                          "arguments": {"name": ids["tool_3"], "params": {"q": "x"}}})
    assert first["output"]["type"] == "error-text" and first["inspected"] == [ids["tool_3"]] and not calls
    # Gemini-style JSON-string params are taken back
    ran = await c.meta({"turnId": "turn-1", "tool": "tool_invoke", "callId": "c2",
                        "arguments": {"name": ids["tool_3"], "params": '{"q": "x"}'}})
    assert ran["effectiveToolName"] == ids["tool_3"] and ran["callId"] == f"c2::{ids['tool_3']}"
    assert calls == [("tool_3", {"q": "x"}, f"c2::{ids['tool_3']}")]
    gated = await c.meta({"turnId": "turn-1", "tool": "tool_inspect", "arguments": {"name": ids["gated"]}})
    assert gated["inspected"] == [ids["gated"]]
    refused = await c.meta({"turnId": "turn-1", "tool": "tool_invoke",
                            "arguments": {"name": ids["gated"], "params": {"q": "x"}}})
    assert "approval" in refused["output"]["value"]
    not_deferred = await c.meta({"turnId": "turn-1", "tool": "tool_invoke",
                                 "arguments": {"name": keep_id, "params": {"q": "x"}}})
    assert "not one of this turn's deferred tools" in not_deferred["output"]["value"]
    bad_args = await c.meta({"turnId": "turn-1", "tool": "tool_search", "arguments": {"limit": 3}})
    assert bad_args["output"]["type"] == "error-text"
    from ctxbuild_platform.errors import NotFound
    with pytest.raises(NotFound):
        await c.meta({"turnId": "nope", "tool": "tool_search", "arguments": {"query": "x"}})


async def test_resolution_is_deterministic_across_replicas_and_a_cold_cache(deferred_world):
    w = deferred_world
    payload = {"serverIds": ["big", "small"], "dialect": "openai-strict", "contextWindow": 2_000}
    first = await w.replica("A").resolve(dict(payload))
    w.cache = InMemoryToolCache()  # cold cache (restart)
    second = await w.replica("B").resolve(dict(payload))
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)


async def test_cancel_refuses_a_call_that_starts_after_it():
    w = World([cfg("s1")])
    c = w.replica("A")
    c.cancel("outer")
    r = await c.invoke("mcp__s1__a_" + "0" * 20, {}, "outer::inner")
    assert r == {"output": {"type": "error-text", "value": "the call was cancelled"}, "cancelled": True}
