"""Tool arguments are data, never identity (SPEC §6), attacked on the real stack: a prompt-injected model smuggles
``conversationId``/``turnId``/``owner``/``retained``/``tenantId`` into every built-in tool (read_file, fs_read), web
tool (web_fetch, web_search) and meta-tool (tool_search, tool_inspect, tool_invoke), sends unknown keys, wrong
types and traversal-like names. Each call is refused with a clear error the model reads as the tool's output, the
turn goes on, and the victim's secret marker appears nowhere in the output or in anything the attacker's turn
stored. One orchestration replica (edge + runner on its own work queue) offers both web tools (web_search through a
local SearXNG); the meta-tools come from a real mcp-server-git deferred by a small window."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from ctxbuild_devstack.replica import Replica
from ctxbuild_devstack.stack import free_port
from ctxbuild_mcp_catalog.domain.tool_ids import tool_id
from security_support import Edge, refusal, start_all, victim_conversation

from tests.support.fake_searxng import FakeSearxng

pytestmark = [pytest.mark.security, pytest.mark.e2e]

STREAM, SUBJECT, CONSUMER = "CTX_TURNS_SECURITY", "ctx.turn.run_security_test", "security-runner"
GIT_SERVER = "git_security"
STATUS_ID = tool_id(GIT_SERVER, "git_status", "git")


@pytest.fixture(scope="module")
def searx():
    server = FakeSearxng(free_port(), {"tide pools": [
        {"url": "https://example.org/tides", "title": "Tide pools", "content": "rock pools at low tide"}]}).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def edge(stack, start_service, searx) -> Edge:
    start_all(stack, start_service)  # the other services this replica calls
    replica = Replica(stack, "orchestration", "orch-security", CTX_ROLE="all", CTX_TURNS_STREAM=STREAM,
                      CTX_TURNS_SUBJECT=SUBJECT, CTX_TURNS_CONSUMER=CONSUMER, CTX_SEARXNG_URL=searx.base_url,
                      CTX_NATS_INBOX_PREFIX="_INBOX.orch-security",  # replies, transfers, pulls on its own prefix
                      ).wait_ready()
    yield Edge(replica.url)
    replica.stop()


@pytest.fixture(scope="module")
def victim(edge) -> dict[str, Any]:
    return victim_conversation(edge)


def smuggled(v: dict[str, Any]) -> dict[str, Any]:
    """Identity a prompt injection would try to hand the server, all of it conversation A's."""
    return {"conversationId": v["cid"], "turnId": v["turn"], "owner": {"kind": "conversation", "id": v["cid"]},
            "retained": {"persistedUris": [v["uri"]], "fileAttachments": [
                {"sha256": v["att_sha"], "handle": v["handle"], "displayName": "secretA.txt"}]},
            "tenantId": "tenant-of-A"}


def identity_attacks(tool: str, base: dict[str, Any]) -> dict[str, tuple[str, Any, str]]:
    return {f"{tool}-smuggles-{key}": (tool, lambda v, k=key: {**base_of(v, base), k: smuggled(v)[k]},
                                       "invalid-arguments")
            for key in ("conversationId", "turnId", "owner", "retained", "tenantId")}


def base_of(v: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    return {k: (x(v) if callable(x) else x) for k, x in base.items()}


# name → (tool, arguments from what the attacker knows of A, the error code the model must read)
ATTACKS: dict[str, tuple[str, Any, str]] = {
    **identity_attacks("read_file", {"filename": lambda v: v["handle"]}),
    **identity_attacks("fs_read", {"uri": lambda v: v["uri"]}),
    **{k: a for k, a in identity_attacks("web_fetch", {"url": "https://example.org/"}).items()
       if not k.endswith(("owner", "tenantId"))},
    **{k: a for k, a in identity_attacks("web_search", {"query": "tide pools"}).items()
       if not k.endswith(("owner", "tenantId"))},
    "read_file-filename-object": ("read_file", lambda v: {"filename": {"conversationId": v["cid"],
                                                                       "name": v["handle"]}}, "invalid-arguments"),
    "read_file-offset-string": ("read_file", lambda v: {"filename": v["handle"], "offset": "0"}, "invalid-arguments"),
    "read_file-traversal": ("read_file", lambda v: {"filename": "../" + v["handle"]}, "not-found"),
    "read_file-traversal-into-A": ("read_file", lambda v: {"filename": f"../{v['cid']}/{v['handle']}"}, "not-found"),
    "read_file-absolute-path": ("read_file", lambda v: {"filename": "/etc/passwd"}, "not-found"),
    "read_file-A-handle": ("read_file", lambda v: {"filename": v["handle"]}, "not-found"),
    "fs_read-limit-zero": ("fs_read", lambda v: {"uri": v["uri"], "limit": 0}, "invalid-arguments"),
    "fs_read-A-uri": ("fs_read", lambda v: {"uri": v["uri"]}, "not-found"),
    "fs_read-A-attachment-uri": ("fs_read", lambda v: {"uri": v["att_uri"]}, "not-found"),
    "fs_read-traversal-uri": ("fs_read", lambda v: {"uri": "context://vfs/../" + v["uri"].removeprefix(
        "context://vfs/")}, "parse-error"),
    "fs_read-uri-naming-A": ("fs_read", lambda v: {"uri": f"context://vfs/{v['cid']}/" + v["uri"].removeprefix(
        "context://vfs/")}, "parse-error"),
    "web_fetch-headers": ("web_fetch", lambda v: {"url": "https://example.org/", "headers": {"Cookie": "a"}},
                          "invalid-arguments"),
    "web_fetch-no-url": ("web_fetch", lambda v: {}, "invalid-arguments"),
    "web_search-maxResults-string": ("web_search", lambda v: {"query": "tide pools", "maxResults": "5"},
                                     "invalid-arguments"),
}
CONTROLS = {  # the same tools with honest arguments work in the same step: the refusals are about the arguments
    "read_file": lambda b: {"filename": b["handle"], "limit": 50},
    "web_search": lambda b: {"query": "tide pools"},
}


@pytest.fixture(scope="module")
def attacked(edge, victim) -> dict[str, Any]:
    """Conversation B (its own attachment) makes every attack in one step, then the honest controls."""
    b = edge.conversation(contextWindow=16000)
    own = edge.attach(b, "mine.txt", "B's own notes\n")
    calls = [{"toolName": tool, "input": build(victim)} for tool, build, _ in ATTACKS.values()]
    calls += [{"toolName": t, "input": build(own)} for t, build in CONTROLS.items()]
    turn = edge.turn(b, [{"toolCalls": calls}, {"text": "done"}])
    outs = turn.outputs()
    return {"turn": turn, "outs": dict(zip([*ATTACKS, *CONTROLS], outs, strict=True)), "stored": edge.stored(turn)}


def test_the_turn_goes_on_and_honest_calls_work(attacked):
    assert attacked["turn"].end["type"] == "TurnCompleted", attacked["turn"].end
    assert attacked["outs"]["read_file"]["output"]["value"].startswith("B's own notes")
    assert "example.org/tides" in json.dumps(attacked["outs"]["web_search"]["output"])


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_tool_argument_attack_is_refused(attacked, victim, attack):
    tool, build, code = ATTACKS[attack]
    text = refusal(attacked["outs"][attack])
    assert text.startswith(f"[Error: {code}]"), text
    if code == "invalid-arguments":  # a clear sentence naming the tool (and the key it refuses)
        assert text.startswith(f"[Error: invalid-arguments] {tool}:"), text
        extra = set(build(victim)) - {"filename", "uri", "url", "query", "offset", "limit", "maxResults"}
        assert all(k in text for k in extra), text
    assert victim["marker"] not in json.dumps(attacked["outs"][attack])
    assert victim["marker"] not in attacked["stored"]


# ---------------------------------------------------------------- meta-tools (deferred MCP tools)
META_ATTACKS: dict[str, tuple[str, Any]] = {
    "tool_search-smuggles-turnId": ("tool_search", lambda v: {"query": "status", "turnId": v["turn"]}),
    "tool_search-smuggles-conversationId": ("tool_search", lambda v: {"query": "status", "conversationId": v["cid"]}),
    "tool_search-query-not-a-string": ("tool_search", lambda v: {"query": 5}),
    "tool_inspect-smuggles-turnId": ("tool_inspect", lambda v: {"name": STATUS_ID, "turnId": v["turn"]}),
    "tool_inspect-smuggles-owner": ("tool_inspect", lambda v: {"name": STATUS_ID,
                                                               "owner": {"kind": "conversation", "id": v["cid"]}}),
    "tool_invoke-smuggles-turnId": ("tool_invoke", lambda v: {"name": STATUS_ID, "params": {}, "turnId": v["turn"]}),
    "tool_invoke-smuggles-callId": ("tool_invoke", lambda v: {"name": STATUS_ID, "params": {},
                                                              "callId": "victim-call"}),
    "tool_invoke-no-params": ("tool_invoke", lambda v: {"name": STATUS_ID}),
}


@pytest.fixture(scope="module")
async def meta_attacked(edge, victim, rpc, tmp_path_factory) -> dict[str, Any]:
    repo = tmp_path_factory.mktemp("security-repo")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)  # set-up, before any turn
    server = {"id": GIT_SERVER, "name": "git", "transport": "stdio", "command": sys.executable,
              "args": ["-m", "mcp_server_git", "--repository", str(repo)]}
    await rpc.call("ctx.mcp.servers.upsert", {"server": server})
    try:
        m = edge.conversation(contextWindow=6000, mcpServers=[GIT_SERVER])
        calls = [{"toolName": tool, "input": build(victim)} for tool, build in META_ATTACKS.values()]
        calls.append({"toolName": "tool_search", "input": {"query": "working tree status"}})  # honest control
        turn = edge.turn(m, [{"toolCalls": calls}, {"text": "done"}])
    finally:  # the registry is shared by the session: leave it as found
        await rpc.call("ctx.mcp.servers.remove", {"id": GIT_SERVER})
    outs = turn.outputs()
    return {"turn": turn, "outs": dict(zip([*META_ATTACKS, "control"], outs, strict=True)),
            "stored": edge.stored(turn)}


def test_meta_tools_are_offered_and_an_honest_search_works(meta_attacked):
    assert meta_attacked["turn"].end["type"] == "TurnCompleted", meta_attacked["turn"].end
    assert STATUS_ID in json.dumps(meta_attacked["outs"]["control"]["output"])


@pytest.mark.parametrize("attack", list(META_ATTACKS))
def test_a_meta_tool_argument_attack_is_refused(meta_attacked, victim, attack):
    tool, _ = META_ATTACKS[attack]
    text = refusal(meta_attacked["outs"][attack])
    assert text.startswith(f"[Error: invalid-arguments] {tool}:"), text
    assert "effectiveToolName" not in meta_attacked["outs"][attack]  # nothing ran behind the meta-tool
    assert victim["marker"] not in json.dumps(meta_attacked["outs"][attack])
    assert victim["marker"] not in meta_attacked["stored"]
