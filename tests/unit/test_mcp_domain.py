"""MCP catalog domain: tool ids, modes and server selection, cache freshness, resolve view, tool outputs."""

from __future__ import annotations

import hashlib
import json
import re

import pytest
from ctxbuild_mcp_catalog.domain import outputs, resolution
from ctxbuild_mcp_catalog.domain.resolution import CacheEntry, ServerRef, ServerView
from ctxbuild_mcp_catalog.domain.tool_ids import (
    MAX_ID_LEN,
    looks_like_tool_id,
    server_prefix,
    servers_for_id,
    slugify,
    tool_id,
)

WIRE_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # the strictest provider function-name rule


def h20(server_id: str, tool_name: str) -> str:
    return hashlib.sha256(server_id.encode() + b"\0" + tool_name.encode()).hexdigest()[:20]


# ---------- tool ids ----------
def test_reference_vectors():
    # literal vectors: a change to the derivation breaks ids stored in histories, so it must be deliberate
    assert tool_id("time", "get_current_time") == "mcp__time__get_current_time_8b5af4dc05e3a09e2e3c"
    assert tool_id("time", "convert_time", "time") == "mcp__time__convert_time_4ae42cdf5bfbee525b1b"


@pytest.mark.parametrize(("server_id", "label", "tool", "server_slug", "tool_slug"), [
    ("fetch", None, "fetch", "fetch", "fetch"),
    ("a1b2c3", "GitHub", "create_pull_request", "github", "create_pull_request"),
    ("srv", "@cherry/Web Search!", "API-post-search", "cherry_web_searc", "api_post_search"),  # 16-char cap
    ("srv", "Café Été", "résumé__tool", "cafe_ete", "resume_tool"),
    ("srv", "日本語", "検索", "server", "tool"),  # nothing ASCII survives → fallbacks; the hash keeps it unique
    ("srv", "__x__", "--y--", "x", "y"),
])
def test_slugging(server_id, label, tool, server_slug, tool_slug):
    tid = tool_id(server_id, tool, label)
    assert tid == f"mcp__{server_slug}__{tool_slug}_{h20(server_id, tool)}"
    assert looks_like_tool_id(tid) and WIRE_NAME.match(tid)


def test_length_is_capped_at_63_and_prefix_is_stable():
    long_server = "A very long MCP server display name that goes on"
    long_tool = "an_extremely_long_tool_name_that_would_never_fit_in_a_function_name_budget_at_all"
    tid = tool_id("srv-1", long_tool, long_server)
    assert len(tid) == MAX_ID_LEN
    assert tid.endswith("_" + h20("srv-1", long_tool))
    assert tid.startswith(server_prefix(long_server)) and server_prefix(long_server) == "mcp__a_very_long_mcp__"
    # every tool of one server shares the prefix, however long the tool slug is
    for name in ("x", long_tool, "mid_sized_tool_name"):
        assert tool_id("srv-1", name, long_server).startswith(server_prefix(long_server))
    # slug edges never end in "_" after truncation (no "___" before the hash)
    assert "___" not in tid


def test_hash_part_depends_on_server_id_and_tool_name_only():
    a = tool_id("s1", "read", "Files")
    assert a == tool_id("s1", "read", "Files")  # deterministic
    assert a != tool_id("s2", "read", "Files")  # same label, other server → other id
    assert a[-20:] == tool_id("s1", "read", "Renamed")[-20:]  # the label only changes the readable part
    # the \0 separator keeps ("ab","c") and ("a","bc") apart
    assert tool_id("ab", "c")[-20:] != tool_id("a", "bc")[-20:]
    # two names with the same slug still differ
    assert tool_id("s", "get-time") != tool_id("s", "get_time")


def test_slugify_never_returns_an_empty_or_separator_bearing_slug():
    for text in ("", "___", "a__b", "-a-", "x" * 100):
        s = slugify(text, 10, "f")
        assert s and "__" not in s and not s.startswith("_") and not s.endswith("_") and len(s) <= 10


def test_servers_for_id_routes_by_prefix():
    servers = {"time": "time", "t2": "timer", "gh": "GitHub"}
    assert servers_for_id(tool_id("time", "now", "time"), servers) == ["time"]
    assert servers_for_id(tool_id("gh", "search", "GitHub"), servers) == ["gh"]
    assert servers_for_id("mcp__nothing__x_" + "0" * 20, servers) == []


def test_real_catalog_tool_ids_are_unique_and_wire_valid(shared_data):
    files = sorted((shared_data / "mcp-catalogs").glob("*.tools.json"))
    assert files
    ids: set[str] = set()
    count = 0
    for f in files:
        doc = json.loads(f.read_text())
        for tool in doc["tools"]:
            tid = tool_id(doc["server"], tool["name"], doc["server"])
            assert len(tid) <= MAX_ID_LEN and WIRE_NAME.match(tid) and looks_like_tool_id(tid), tid
            assert tid.startswith(server_prefix(doc["server"]))
            ids.add(tid)
            count += 1
    assert len(ids) == count


# ---------- modes and selection ----------
CONFIGURED = [ServerRef("time"), ServerRef("fetch"), ServerRef("off", active=False),
              ServerRef("dis", enabled=False)]


def test_default_mode_is_manual():
    assert resolution.DEFAULT_MODE == "manual"
    assert resolution.normalize_mode(None) == "manual"
    with pytest.raises(ValueError):
        resolution.normalize_mode("everything")


@pytest.mark.parametrize(("mode", "linked", "expected"), [
    ("manual", ["fetch"], ["fetch"]),
    ("manual", None, []),  # no linked servers → none (never "all")
    ("manual", [], []),
    ("manual", ["fetch", "time", "fetch", "ghost"], ["fetch", "time", "ghost"]),  # order kept, deduped
    ("manual", ["off"], ["off"]),  # explicitly linked, even if not in the auto pool
    ("manual", ["dis"], ["dis"]),  # a disabled server is kept, so the reply can say it is disabled
    ("auto", None, ["time", "fetch"]),  # every active enabled server, registry order
    ("auto", ["fetch"], ["time", "fetch"]),  # auto ignores the links
    ("disabled", ["time"], []),
])
def test_select_servers(mode, linked, expected):
    assert resolution.select_servers(mode, linked, CONFIGURED) == expected


# ---------- cache freshness ----------
def tool(sid: str, name: str) -> dict:
    return {"id": tool_id(sid, name), "name": name, "serverId": sid, "description": "", "inputSchema": {}}


def test_needs_warm_policy():
    now = 10_000.0
    assert resolution.needs_warm(None, now)
    assert resolution.needs_warm(resolution.COLD, now)
    ready = resolution.ready_entry([tool("s", "a")], now - 10_000)
    assert not resolution.needs_warm(ready, now)  # a non-empty list stays until the server says it changed
    assert resolution.needs_warm(CacheEntry(ready.status, ready.tools, None, ready.updated_at,
                                            ready.fingerprint, stale=True), now)
    empty = resolution.ready_entry([], now - 299)
    assert not resolution.needs_warm(empty, now)
    assert resolution.needs_warm(resolution.ready_entry([], now - 300), now)  # empty → retried after 5 min
    failed = resolution.failed_entry(None, "boom", now - 29)
    assert not resolution.needs_warm(failed, now)
    assert resolution.needs_warm(resolution.failed_entry(None, "boom", now - 30), now)  # failure → after 30 s


def test_change_is_signalled_only_when_the_list_really_changed():
    a = resolution.ready_entry([tool("s", "a"), tool("s", "b")], 1.0)
    same = resolution.ready_entry([tool("s", "b"), tool("s", "a")], 2.0)  # other order, other time
    assert not resolution.changed(a, same)
    assert resolution.changed(None, a)
    assert resolution.changed(a, resolution.ready_entry([tool("s", "a")], 3.0))
    assert resolution.changed(a, resolution.failed_entry(None, "x", 4.0))


# ---------- resolve view ----------
def views(*ids: str, unregistered: tuple[str, ...] = (), disabled: tuple[str, ...] = ()) -> list[ServerView]:
    return [ServerView(i, i not in unregistered, i not in disabled) for i in ids]


def test_resolve_reports_every_selected_server_and_never_hides_a_cold_one():
    entries = {
        "time": resolution.ready_entry([tool("time", "now"), tool("time", "convert")], 1.0),
        "fetch": None,  # cold, warm-up still running after the bounded wait
        "git": resolution.failed_entry(None, "spawn failed: ENOENT", 1.0),
        "off": None,
    }
    r = resolution.resolve(views("fetch", "time", "git", "ghost", "off", unregistered=("ghost",),
                                 disabled=("off",)), entries, warming=["fetch"])
    assert [t["name"] for t in r.tools] == ["convert", "now"]
    assert r.servers == [
        {"id": "fetch", "status": "warming"},
        {"id": "time", "status": "ready"},
        {"id": "git", "status": "error", "error": "spawn failed: ENOENT"},
        {"id": "ghost", "status": "error", "error": "MCP server is not registered"},
        {"id": "off", "status": "disabled"},
    ]


def test_resolve_serves_the_last_good_list_during_a_refresh_and_warming_beats_an_old_failure():
    entries = {"time": resolution.ready_entry([tool("time", "now")], 1.0),
               "git": resolution.failed_entry(None, "old failure", 1.0)}
    r = resolution.resolve(views("time", "git"), entries, warming=["time", "git"])
    assert r.servers == [{"id": "time", "status": "ready"}, {"id": "git", "status": "warming"}]
    assert len(r.tools) == 1


def test_a_failed_refresh_keeps_no_tools_on_the_wire():
    prev = resolution.ready_entry([tool("s", "a")], 1.0)
    failed = resolution.failed_entry(prev, "crashed", 2.0)
    r = resolution.resolve(views("s"), {"s": failed})
    assert r.tools == [] and r.servers == [{"id": "s", "status": "error", "error": "crashed"}]


def test_a_list_taken_with_another_config_is_not_served():
    entry = resolution.ready_entry([tool("s", "a")], 1.0, config="old")
    assert resolution.needs_warm(entry, 2.0, "new") and not resolution.needs_warm(entry, 2.0, "old")
    r = resolution.resolve([ServerView("s", True, True, "new")], {"s": entry})
    assert r.tools == [] and r.servers == [{"id": "s", "status": "warming"}]


def test_cache_entry_round_trips_through_json():
    e = resolution.ready_entry([tool("s", "a"), tool("s", "b")], 12.5, config="abc")
    assert CacheEntry.from_json(e.to_json()) == e
    f = resolution.failed_entry(e, "boom", 13.0, "abc").with_stale()
    assert CacheEntry.from_json(f.to_json()) == f


# ---------- outputs ----------
def test_call_outputs():
    blocks = [{"type": "text", "text": "hello"}, {"type": "image", "data": "AAAA", "mimeType": "image/png"}]
    assert outputs.call_output(blocks, False) == {"type": "content", "value": blocks}
    assert outputs.call_output(blocks, True) == {"type": "error-text", "value": "hello"}
    assert outputs.call_output([], False, {"x": 1}) == {"type": "content",
                                                        "value": [{"type": "text", "text": '{"x":1}'}],
                                                        "metadata": {"structuredContent": {"x": 1}}}
    # structured content rides along intact next to the blocks
    both = outputs.call_output(blocks, False, {"t": [1, 2]})
    assert both == {"type": "content", "value": blocks, "metadata": {"structuredContent": {"t": [1, 2]}}}
    assert outputs.call_output([], True) == {"type": "error-text",
                                             "value": "the tool reported an error without details"}
    img_err = outputs.call_output(blocks[1:], True)
    assert img_err["type"] == "error-text" and json.loads(img_err["value"]) == blocks[1:]
