"""The wire-schema sanitizers, deferral and search over the 14 real MCP catalogs in ../shared/data/mcp-catalogs
(third-party `tools/list` answers). Skips cleanly when the shared data folder is absent."""

from __future__ import annotations

from pathlib import Path

import pytest
from ctxbuild_mcp_catalog.adapters.catalog_files import load_catalogs
from ctxbuild_mcp_catalog.domain import deferral, meta, schemas
from ctxbuild_mcp_catalog.domain.schemas import DIALECTS, check_examples, check_wire, wire_tool

pytestmark = pytest.mark.shared_data


@pytest.fixture(scope="module")
def catalogs(shared_data: Path) -> dict[str, list[dict]]:
    files = sorted((shared_data / "mcp-catalogs").glob("*.tools.json"))
    if not files:
        pytest.skip("no MCP catalogs in the shared data folder")
    return load_catalogs(shared_data / "mcp-catalogs")


def test_there_are_14_catalogs(catalogs):
    assert len(catalogs) == 14 and sum(len(v) for v in catalogs.values()) == 181


@pytest.mark.parametrize("dialect", DIALECTS)
def test_every_wire_schema_is_valid_and_every_example_sent_is_valid(catalogs, dialect):
    problems = []
    for server, tools in catalogs.items():
        for t in tools:
            wire, _ = wire_tool(t["id"], t["description"], t["inputSchema"], dialect)
            for p in check_wire(wire["inputSchema"], dialect, wire.get("strict")):
                problems.append(f"{server}/{t['name']}: {p}")
            assert check_examples(wire, dialect) == 0
        # the meta-tools built over this catalog (examples taken from its first tool)
        for m in meta.definitions(tools):
            wire, _ = wire_tool(m["name"], m["description"], m["inputSchema"], dialect, m["inputExamples"])
            problems += [f"{server}/{m['name']}: {p}" for p in check_wire(wire["inputSchema"], dialect,
                                                                           wire.get("strict"))]
            assert check_examples(wire, dialect) == 0
            if dialect == "anthropic" and m["name"] == "tool_invoke":
                assert wire["inputExamples"], server  # finding #1: the example survives, valid
    assert problems == []


def test_explicit_open_objects_survive_on_the_anthropic_wire(catalogs):
    def count(server, dialect=None):
        return sum(schemas.count_open_objects(
            t["inputSchema"] if dialect is None else wire_tool(t["id"], "", t["inputSchema"], dialect)[0]
            ["inputSchema"]) for t in catalogs[server])

    assert count("notion-mcp-server") == 193
    assert count("notion-mcp-server", "anthropic") == 193
    assert count("notion-mcp-server", "openai") == 193
    assert count("mongodb-mcp-server", "anthropic") == count("mongodb-mcp-server") == 24
    for closed in ("server-github", "playwright-mcp"):  # negative controls
        assert count(closed) == 0 and count(closed, "anthropic") == 0


def test_gemini_sends_open_objects_as_json_strings_and_they_come_back(catalogs):
    mongo = {t["name"]: t for t in catalogs["mongodb-mcp-server"]}
    find = mongo["find"]
    wire = wire_tool(find["id"], "", find["inputSchema"], "gemini")[0]["inputSchema"]
    assert wire["properties"]["filter"]["type"] == "string"
    args = schemas.coerce_arguments(find["inputSchema"], {"database": "d", "collection": "c",
                                                          "filter": '{"age": {"$gt": 3}}'})
    assert args["filter"] == {"age": {"$gt": 3}}


def test_strict_mode_is_used_wherever_it_keeps_the_meaning(catalogs):
    strict = {s: sum(wire_tool(t["id"], "", t["inputSchema"], "openai-strict")[0]["strict"] for t in tools)
              for s, tools in catalogs.items()}
    assert strict["server-github"] == len(catalogs["server-github"])
    assert strict["mcp-server-git"] == 12 and strict["mcp-server-time"] == 2
    assert strict["notion-mcp-server"] == 0  # every tool carries open objects in its $defs


def test_deferral_over_the_union(catalogs):
    union = [t for tools in catalogs.values() for t in tools]
    for window, expect in ((200_000, True), (32_000, True), (10_000_000, False)):
        cands = []
        for t in union:
            wire = wire_tool(t["id"], t["description"], t["inputSchema"], "anthropic")[0]
            cands.append(deferral.Candidate(t["id"], "auto", deferral.tool_cost(t["id"], t["description"],
                                                                                  wire["inputSchema"])))
        d = deferral.decide(cands, window)
        assert d.auto_deferred is expect and d.auto_count == 181
        assert d.auto_cost > 30_000


@pytest.mark.parametrize(("query", "server", "name"), [
    ("create a pull request", "server-github", "create_pull_request"),
    ("navigate the browser to a url", "playwright-mcp", "browser_navigate"),
    ("current time in a timezone", "mcp-server-time", "get_current_time"),
    ("commit the changes with a message", "mcp-server-git", "git_commit"),
    ("web search", "tavily-mcp", "tavily_search"),
])
def test_bm25_over_the_union_finds_the_obvious_tool(catalogs, query, server, name):
    union = [t for tools in catalogs.values() for t in tools]
    top = meta.SearchIndex(union).search(query, 3)
    assert (top[0][0]["serverId"], top[0][0]["name"]) == (server, name), [(t["name"], s) for t, s in top]
