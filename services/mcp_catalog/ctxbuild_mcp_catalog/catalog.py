"""The catalog: configured servers, their sessions, the tool cache, warm-up and the two operations.

- ``warm`` is single-flight per server: concurrent callers share one task, and a caller giving up (its
  timeout) never cancels it.
- ``resolve`` awaits the selected servers' warm-ups, bounded (finding #6), then reports each server's state.
- ``invoke`` routes a tool id to its server through the cache (warming a cold server first) and maps the
  result to a ToolOutput.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

import mcp_types
import structlog
from ctxbuild_platform.errors import DependencyUnavailable, NotFound
from ctxbuild_platform.telemetry import span
from mcp.shared.exceptions import MCPError

from .adapters.mcp_session import ConnectionLost, McpConnection, describe
from .adapters.tool_cache import InMemoryToolCache
from .domain import outputs, resolution
from .domain.resolution import ServerRef, Status
from .domain.tool_ids import servers_for_id, tool_id
from .settings import McpServerConfig, Settings

log = structlog.get_logger("mcp_catalog")


def wire_tool(server: McpServerConfig, tool: mcp_types.Tool) -> dict[str, Any]:
    return {
        "id": tool_id(server.id, tool.name, server.label),
        "name": tool.name,
        "serverId": server.id,
        "description": tool.description or "",
        "inputSchema": tool.input_schema,
    }


def dump_block(block: Any) -> dict[str, Any]:
    return block.model_dump(mode="json", by_alias=True, exclude_none=True)


class Catalog:
    def __init__(self, settings: Settings, cache: InMemoryToolCache | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.servers: dict[str, McpServerConfig] = {s.id: s for s in settings.mcp_servers}
        self.cache = cache or InMemoryToolCache()
        self.clock = clock
        self._conns: dict[str, McpConnection] = {}
        self._conn_locks: dict[str, asyncio.Lock] = {s: asyncio.Lock() for s in self.servers}
        self._warming: dict[str, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._started = False
        self._closed = False

    # ---------- lifecycle ----------
    async def start(self) -> None:
        """Prewarm the active servers in the background (a few at a time); never blocks start-up."""
        self._spawn(self._prewarm(), "mcp-prewarm")
        self._started = True

    async def _prewarm(self) -> None:
        sem = asyncio.Semaphore(self.settings.prewarm_concurrency)

        async def one(sid: str) -> None:
            async with sem:
                task = self.warm(sid)
                await asyncio.wait([task])

        await asyncio.gather(*(one(s.id) for s in self.servers.values() if s.active))

    async def ready(self) -> bool:
        """Ready once the prewarm is under way: a slow or failing server is reported, not fatal."""
        return self._started and not self._closed

    async def close(self) -> None:
        self._closed = True
        for task in [*self._warming.values(), *self._background]:
            task.cancel()
        await asyncio.gather(*self._warming.values(), *self._background, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self._conns.values()), return_exceptions=True)
        self._conns.clear()

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # ---------- sessions ----------
    async def _connection(self, sid: str) -> McpConnection:
        """The server's live session, opening a new one (one at a time per server) when there is none."""
        async with self._conn_locks[sid]:
            conn = self._conns.get(sid)
            if conn is not None and conn.alive:
                return conn
            if conn is not None:
                await conn.close()
            cfg = self.servers[sid]
            conn = McpConnection(sid, cfg.command, cfg.args, cfg.env, cfg.cwd,
                                 on_tools_changed=lambda: self._on_tools_changed(sid))
            await conn.open(self.settings.server_start_timeout_s)
            self._conns[sid] = conn
            log.info("mcp-session-open", server=sid, protocol=conn.protocol_version)
            return conn

    def _on_tools_changed(self, sid: str) -> None:
        async def refresh() -> None:
            await self.cache.mark_stale(sid)
            self.warm(sid)

        self._spawn(refresh(), f"mcp-refresh-{sid}")

    # ---------- warm-up ----------
    def warm(self, sid: str) -> asyncio.Task[None]:
        """Start (or join) the warm-up of one server: single flight per server."""
        task = self._warming.get(sid)
        if task is None or task.done():
            task = asyncio.create_task(self._warm(sid), name=f"mcp-warm-{sid}")
            self._warming[sid] = task
        return task

    async def _warm(self, sid: str) -> None:
        cfg = self.servers[sid]
        previous = await self.cache.get(sid)
        with span("mcp.warm", **{"mcp.server": sid}):
            try:
                async with asyncio.timeout(self.settings.server_start_timeout_s):
                    tools = await self._list_tools(sid)
                entry = resolution.ready_entry([wire_tool(cfg, t) for t in tools], self.clock())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure is the server's state, reported on resolve
                error = "warm-up timed out" if isinstance(exc, TimeoutError) else describe(exc)
                entry = resolution.failed_entry(previous, error, self.clock())
                conn = self._conns.pop(sid, None)
                if conn is not None:
                    await conn.close()
            if await self.cache.put(sid, entry):
                log.info("mcp-tools-changed", server=sid, status=entry.status.value, tools=len(entry.tools),
                         error=entry.error)

    async def _list_tools(self, sid: str) -> list[mcp_types.Tool]:
        conn = await self._connection(sid)
        try:
            return await conn.list_tools(self.settings.server_start_timeout_s)
        except ConnectionLost:
            # the old session died since its last use: one fresh session, then give up
            conn = await self._connection(sid)
            return await conn.list_tools(self.settings.server_start_timeout_s)

    async def _warm_if_needed(self, sids: Iterable[str]) -> list[asyncio.Task[None]]:
        now = self.clock()
        tasks = []
        for sid in sids:
            running = self._warming.get(sid)
            if running is not None and not running.done():
                tasks.append(running)
            elif resolution.needs_warm(await self.cache.get(sid), now):
                tasks.append(self.warm(sid))
        return tasks

    async def _await_warm(self, sids: Iterable[str], timeout: float) -> None:
        tasks = await self._warm_if_needed(sids)
        if tasks and timeout > 0:
            await asyncio.wait(tasks, timeout=timeout)  # never cancels the shared warm-ups

    def _in_flight(self) -> set[str]:
        return {sid for sid, t in self._warming.items() if not t.done()}

    # ---------- operations ----------
    async def resolve(self, mode: str | None, server_ids: list[str] | None,
                      warm_timeout_s: float | None) -> dict[str, Any]:
        m = resolution.normalize_mode(mode)
        refs = [ServerRef(s.id, s.active) for s in self.servers.values()]
        selected = resolution.select_servers(m, server_ids, refs)
        known = [sid for sid in selected if sid in self.servers]
        timeout = self.settings.warm_timeout_s if warm_timeout_s is None else warm_timeout_s
        with span("mcp.resolve", **{"mcp.mode": m, "mcp.servers": len(selected)}):
            await self._await_warm(known, timeout)
            entries = await self.cache.get_many(known)
            return resolution.resolve(selected, entries, self.servers, self._in_flight()).to_payload()

    async def invoke(self, tid: str, arguments: dict[str, Any], call_id: str | None) -> dict[str, Any]:
        hit = await self.cache.find(tid)
        if hit is None:
            candidates = servers_for_id(tid, {s.id: s.label for s in self.servers.values()})
            await self._await_warm(candidates, self.settings.warm_timeout_s)
            hit = await self.cache.find(tid)
            if hit is None:
                self._raise_not_found(tid, candidates, await self.cache.get_many(candidates))
        assert hit is not None
        sid, tool = hit
        with span("mcp.invoke", **{"mcp.server": sid, "mcp.tool": tool["name"], "tool.call_id": call_id}):
            try:
                conn = await self._connection(sid)
            except Exception as exc:
                raise DependencyUnavailable(f"MCP server {sid!r} is not available: {describe(exc)}") from exc
            try:
                result = await conn.call_tool(tool["name"], arguments, self.settings.call_timeout_s)
            except ConnectionLost as exc:
                log.warning("mcp-call-connection-lost", server=sid, tool=tool["name"], call_id=call_id)
                return {"output": outputs.error_text(
                    f"the MCP server {sid!r} closed the connection during the call ({exc}); "
                    "the call may not have completed")}
            except TimeoutError:
                return {"output": outputs.error_text(
                    f"the MCP tool {tool['name']!r} did not answer within {self.settings.call_timeout_s:g} s")}
            except MCPError as exc:
                return {"output": outputs.error_text(describe(exc))}
            except Exception as exc:  # noqa: BLE001 - e.g. the SDK rejecting the result shape
                log.warning("mcp-call-failed", server=sid, tool=tool["name"], error=describe(exc))
                return {"output": outputs.error_text(describe(exc))}
            blocks = [dump_block(b) for b in result.content]
            return {"output": outputs.call_output(blocks, bool(result.is_error), result.structured_content)}

    @staticmethod
    def _raise_not_found(tid: str, candidates: list[str],
                         entries: dict[str, resolution.CacheEntry | None]) -> None:
        unready = {sid: e for sid, e in entries.items() if e is None or e.status != Status.READY}
        if unready:
            why = "; ".join(f"{sid}: {e.error if e and e.error else 'warming'}" for sid, e in unready.items())
            raise DependencyUnavailable(f"MCP tool {tid!r}: its server is not ready ({why})",
                                        details={"toolId": tid, "servers": sorted(unready)})
        raise NotFound(f"unknown MCP tool {tid!r}", details={"toolId": tid})

    async def status(self) -> list[dict[str, Any]]:
        """Every configured server's state (for the /mcp/servers probe); ``cold`` = never warmed here."""
        entries = await self.cache.get_many(list(self.servers))
        in_flight = self._in_flight()
        view = resolution.resolve(list(self.servers), entries, self.servers, in_flight)
        out = []
        for s in view.servers:
            sid, entry = s["id"], entries[s["id"]]
            cold = (entry is None or entry.status == Status.COLD) and sid not in in_flight
            out.append({**s, "status": "cold" if cold else s["status"],
                        "tools": len(entry.tools) if entry and entry.status == Status.READY else 0,
                        "active": self.servers[sid].active})
        return out
