"""Deferral vectors (SPEC §11) and the meta-tools: BM25 search, inspect, tool_invoke's guards in order."""

from __future__ import annotations

import json
import math

import pytest
from ctxbuild_mcp_catalog.domain import deferral, meta
from ctxbuild_mcp_catalog.domain.deferral import Candidate, decide, threshold
from ctxbuild_mcp_catalog.domain.tool_ids import tool_id


# ---------- threshold ----------
@pytest.mark.parametrize(("window", "expected"), [
    (200_000, 20_000), (32_000, 3_200), (16_000, 1_600), (1_000, 100), (128_001, 12_800),
    (None, 32_000), (0, 32_000), (-5, 32_000), (math.inf, 32_000), (math.nan, 32_000), ("200000", 32_000),
    (True, 32_000),
])
def test_threshold(window, expected):
    assert threshold(window) == expected


def pool(n: int, cost: int, defer: str = "auto") -> list[Candidate]:
    return [Candidate(f"t{i}", defer, cost) for i in range(n)]


# ---------- the three conditions ----------
@pytest.mark.parametrize(("tools", "window", "deferred", "reason"), [
    (pool(5, 4_001), 200_000, True, "auto-pool-deferred"),  # 20,005 > 20,000
    (pool(5, 4_000), 200_000, False, "auto-pool-cost-within-threshold"),  # exactly the threshold: kept
    (pool(4, 100_000), 200_000, False, "auto-pool-under-5-tools"),  # 4 huge tools: never deferred
    (pool(5, 100), 1_000, False, "auto-pool-cost-at-most-500"),  # 500 > 100 but not > 500
    (pool(5, 101), 1_000, True, "auto-pool-deferred"),  # 505 > 500 and > 100
    (pool(6, 5_334), None, True, "auto-pool-deferred"),  # unknown window: 32,004 > 32,000
    (pool(6, 5_333), None, False, "auto-pool-cost-within-threshold"),  # 31,998
    ([], 200_000, False, "no-auto-tools"),
])
def test_auto_pool_is_deferred_as_a_whole_only_when_all_three_hold(tools, window, deferred, reason):
    d = decide(tools, window)
    assert d.auto_deferred is deferred and d.reason == reason
    assert d.deferred == ([t.id for t in tools] if deferred else [])


def test_always_tools_are_always_deferred_and_never_tools_never():
    tools = [Candidate("a", "always", 10), Candidate("n", "never", 50_000), *pool(5, 10)]
    d = decide(tools, 200_000)
    assert d.deferred == ["a"] and not d.auto_deferred
    assert d.reason == "auto-pool-cost-at-most-500; always-tools-deferred"
    big = [Candidate("n", "never", 50_000), *pool(5, 5_000), Candidate("a", "always", 1)]
    d = decide(big, 200_000)
    assert d.deferred == ["t0", "t1", "t2", "t3", "t4", "a"] and "n" not in d.deferred
    assert d.auto_cost == 25_000 and d.deferred_cost == 25_001  # the never-tool does not count in the pool


def test_cost_is_tokens_of_compact_json():
    from ctxbuild_codec.tokens import count_text

    schema = {"type": "object", "properties": {"q": {"type": "string"}}}
    assert deferral.tool_cost("n", "d", schema) == count_text(
        '{"name":"n","description":"d","schema":{"type":"object","properties":{"q":{"type":"string"}}}}')


def test_system_prompt_block_lists_namespaces_with_counts():
    tools = [{"serverId": "gh", "namespace": "GitHub"}] * 3 + [{"serverId": "n", "namespace": "notion"}]
    spaces = deferral.namespaces(tools)
    assert spaces == [{"namespace": "GitHub", "serverId": "gh", "count": 3},
                      {"namespace": "notion", "serverId": "n", "count": 1}]
    block = deferral.system_prompt_block(spaces)
    assert block.startswith("<deferred-tools>\n") and block.endswith("\n</deferred-tools>")
    assert "- GitHub: 3 tools\n- notion: 1 tool" in block and "4 more tools" in block
    for m in meta.META_TOOLS:
        assert m in block


# ---------- search ----------
def catalog() -> list[dict]:
    def t(server, name, desc, props):
        return {"id": tool_id(server, name), "name": name, "serverId": server, "namespace": server,
                "description": desc, "inputSchema": {"type": "object", "properties": {p: {"type": "string"}
                                                                                       for p in props}}}
    return [
        t("github", "create_issue", "Create a new issue in a GitHub repository", ["owner", "repo", "title"]),
        t("github", "list_pull_requests", "List pull requests", ["owner", "repo", "state"]),
        t("time", "get_current_time", "Get current time in a specific timezone", ["timezone"]),
        t("time", "convert_time", "Convert time between timezones", ["source_timezone", "target_timezone"]),
        t("fs", "read_text_file", "Read the complete contents of a file", ["path", "head", "tail"]),
    ]


def test_bm25_ranks_by_name_description_and_parameter_names():
    idx = meta.SearchIndex(catalog())
    assert [t["name"] for t, _ in idx.search("current time", 2)] == ["get_current_time", "convert_time"]
    assert idx.search("pull requests")[0][0]["name"] == "list_pull_requests"  # camel/snake split, plural stem
    assert idx.search("issues")[0][0]["name"] == "create_issue"
    assert idx.search("targetTimezone")[0][0]["name"] == "convert_time"  # parameter names count
    assert idx.search("file contents")[0][0]["name"] == "read_text_file"
    assert idx.search("zebra") == [] and idx.search("the of") == []
    assert idx.search("time", 10) == idx.search("time", 10)  # deterministic


def test_search_output_shape():
    idx = meta.SearchIndex(catalog())
    out = meta.search_output(idx, "timezone", 5, ["github", "time", "fs"])
    value = json.loads(out["value"])
    assert out["type"] == "text" and value["results"][0]["name"].startswith("mcp__time__")
    miss = json.loads(meta.search_output(idx, "zebra", 5, ["github", "time"])["value"])
    assert miss["results"] == [] and "github, time" in miss["hint"]


# ---------- tool_invoke guards, in the spec's order ----------
def test_tool_invoke_guards_in_order():
    tools = catalog()
    gct = tools[2]
    name = gct["id"]
    deferred = [t["id"] for t in tools]
    ok = meta.Lookup(gct)

    def run(n=name, params=None, deferred=deferred, inspected=(name,), lookup=ok):
        return meta.check_invoke(n, params if params is not None else {"timezone": "UTC"}, deferred, inspected,
                                 lookup)

    # 1. allowed name: a name outside the turn's deferred set (or a meta-tool) is refused first
    for bad in ("read_file", "tool_invoke", 42):
        r = run(n=bad, lookup=None)
        assert r.output["type"] == "error-text" and "not one of this turn's deferred tools" in r.output["value"]
    # 2. exists
    r = run(lookup=meta.Lookup(None))
    assert "no longer exists" in r.output["value"]
    # 3. executable (checked before approval and inspection)
    r = run(lookup=meta.Lookup(gct, "the server 'time' is not ready (warming)", "required"), inspected=())
    assert "cannot run now" in r.output["value"]
    # 4. not approval-gated (checked before inspection)
    r = run(lookup=meta.Lookup(gct, None, "required"), inspected=())
    assert "approval" in r.output["value"]
    # 5. inspected, else the signature (and the name is now inspected)
    r = run(inspected=())
    assert r.inspected == name and r.tool is None
    assert json.loads(r.output["value"].split("\n", 1)[1])["name"] == name
    # 6. params valid, else the signature
    r = run(params={"timezone": 3})
    assert r.output["type"] == "error-text" and "/timezone" in r.output["value"]
    assert json.loads(r.output["value"].split("\n", 1)[1])["parameters"]["properties"]["timezone"]
    # all guards pass: run it (params taken back from the wire first)
    r = run()
    assert r.output is None and r.tool is gct and r.params == {"timezone": "UTC"}
    assert meta.inner_call_id("call_7", name) == f"call_7::{name}"


def test_example_params_are_valid_for_the_inner_tool():
    schema = {"type": "object", "properties": {"mode": {"enum": ["a", "b"]}, "n": {"type": "integer",
                                                                                   "minimum": 5},
                                               "q": {"type": "string", "default": "hi"}},
              "required": ["mode", "n", "q"]}
    assert meta.example_params(schema) == {"mode": "a", "n": 5, "q": "hi"}
    assert meta.example_params({"type": "object", "properties": {"x": {"type": "string", "minLength": 99}},
                                "required": ["x"]}) == {}
