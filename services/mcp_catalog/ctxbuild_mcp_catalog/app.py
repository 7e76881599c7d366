"""The catalog: the registry's servers, their sessions (per replica), the shared tool cache, warm-ups and the
operations behind the subjects.

- ``warm`` is single-flight per server in this replica (concurrent callers share one task; a caller giving up
  never cancels it) AND across replicas (a KV lease: one replica lists, the others wait for its cache entry).
- ``resolve`` awaits the selected servers' warm-ups, bounded (finding #6), reports each server's state, and —
  when the caller names a wire dialect — returns wire-safe schemas and the deferral decision.
- ``invoke`` routes a tool id to its server through the cache (warming a cold server first), with a timeout and
  cancellation (``ctx.mcp.cancel``); ``meta`` runs tool_search / tool_inspect / tool_invoke for a turn.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import mcp_types
import structlog
from ctxbuild_platform.errors import DependencyUnavailable, InvalidPayload, NotFound
from ctxbuild_platform.telemetry import span
from jsonschema import Draft202012Validator
from mcp.shared.exceptions import MCPError

from .adapters.embedder import load_embedder
from .adapters.mcp_session import ConnectionLost, McpConnection, describe
from .adapters.registry import ServerRecord
from .adapters.tool_cache import ToolVectors, run_key
from .domain import deferral, meta, outputs, ranking, resolution, schemas
from .domain.resolution import ServerRef, ServerView, Status
from .domain.tool_ids import servers_for_id
from .domain.tools import cached_tool, compact, fingerprint, wire_cost
from .settings import McpServerConfig, Settings

log = structlog.get_logger("mcp_catalog")
Publish = Callable[[dict[str, Any]], Awaitable[None]]
CANCEL_MEMORY_S = 120.0
RUN_POLL_S = 0.25  # how often a re-asked call in flight elsewhere is looked up again


def wire_tool(server: McpServerConfig, tool: mcp_types.Tool) -> dict[str, Any]:
    """The cached form of one MCP tool."""
    ann = (tool.annotations.model_dump(mode="json", by_alias=True, exclude_none=True)
           if tool.annotations is not None else None)
    return cached_tool(server.id, server.label, tool.name, tool.description, tool.input_schema, ann)


class Catalog:
    def __init__(self, settings: Settings, registry: Any, cache: Any, turns: Any, *,
                 publish: Publish | None = None, clock: Callable[[], float] = time.time,
                 embedder: Any | None = None, runs: Any | None = None) -> None:
        self.settings = settings
        self.registry = registry
        self.cache = cache
        self.turns = turns
        self.runs = runs  # the tool-run ledger: a call of a turn runs at most once (None: not kept)
        self.publish = publish
        self.clock = clock
        self.replica = settings.replica_id or f"{socket.gethostname()}:{os.getpid()}"
        self.lease_wait_s = max(settings.lease_ttl_s, settings.server_start_timeout_s) + 5.0
        self._conns: dict[str, McpConnection] = {}
        self._conn_locks: dict[str, asyncio.Lock] = {}
        self._warming: dict[str, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._calls: dict[str, set[asyncio.Task[Any]]] = {}
        self._cancelled: dict[str, float] = {}
        self._started = False
        self._closed = False
        # tool_search: hybrid ranking with an embedder (load_embedder at start-up), else lexical only
        self.embedder = embedder
        self.tool_vectors = ToolVectors(cache, embedder) if embedder is not None else None
        self._indexes: OrderedDict[tuple[tuple[str, str], ...], meta.SearchIndex] = OrderedDict()

    # ---------- lifecycle ----------
    async def load_embedder(self) -> None:
        """Load the embedding model once for this replica (before subscribing); a failure is logged and
        tool_search ranks lexically."""
        if self.embedder is None and self.settings.tool_search_semantic:
            self.embedder = await asyncio.to_thread(load_embedder)
            if self.embedder is not None:
                self.tool_vectors = ToolVectors(self.cache, self.embedder)

    async def start(self) -> None:
        """Prewarm the active servers in the background (a few at a time); never blocks start-up."""
        self._spawn(self._prewarm(), "mcp-prewarm")
        self._started = True

    async def _prewarm(self) -> None:
        sem = asyncio.Semaphore(self.settings.prewarm_concurrency)
        try:
            servers = await self._servers()
        except Exception as exc:  # noqa: BLE001
            log.warning("prewarm-skipped", error=describe(exc))
            return

        async def one(cfg: McpServerConfig) -> None:
            async with sem:
                await asyncio.wait([self.warm(cfg)])

        await asyncio.gather(*(one(c) for c in servers.values() if c.active and c.enabled))

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

    async def _records(self) -> list[ServerRecord]:
        return await self.registry.list()

    async def _servers(self) -> OrderedDict[str, McpServerConfig]:
        return OrderedDict((r.config.id, r.config) for r in await self._records())

    # ---------- sessions ----------
    async def _connection(self, cfg: McpServerConfig) -> McpConnection:
        """The server's live session in this replica, opening a new one (one at a time per server) when there
        is none or the server's connection config changed."""
        sid = cfg.id
        lock = self._conn_locks.setdefault(sid, asyncio.Lock())
        async with lock:
            conn = self._conns.get(sid)
            if conn is not None and conn.alive and conn.config_hash == cfg.connection_hash():
                return conn
            if conn is not None:
                self._conns.pop(sid, None)
                await conn.close()
            conn = McpConnection(cfg, on_tools_changed=lambda: self._on_tools_changed(sid))
            await conn.open(self.settings.server_start_timeout_s)
            self._conns[sid] = conn
            log.info("mcp-session-open", server=sid, transport=cfg.transport, protocol=conn.protocol_version)
            return conn

    async def drop_connection(self, sid: str) -> None:
        conn = self._conns.pop(sid, None)
        if conn is not None:
            await conn.close()

    def _on_tools_changed(self, sid: str) -> None:
        async def refresh() -> None:
            await self.cache.mark_stale(sid)
            cfg = (await self._servers()).get(sid)
            if cfg is not None and cfg.enabled:
                self.warm(cfg)

        self._spawn(refresh(), f"mcp-refresh-{sid}")

    # ---------- warm-up ----------
    def warm(self, cfg: McpServerConfig) -> asyncio.Task[None]:
        """Start (or join) the warm-up of one server: single flight per server in this replica."""
        task = self._warming.get(cfg.id)
        if task is None or task.done():
            task = asyncio.create_task(self._warm(cfg), name=f"mcp-warm-{cfg.id}")
            self._warming[cfg.id] = task
        return task

    async def _warm(self, cfg: McpServerConfig) -> None:
        """Single flight across replicas: take the server's lease and list its tools, or wait until the lease
        holder has written a fresh entry (or its lease expired, then take over)."""
        sid, chash = cfg.id, cfg.connection_hash()
        deadline = time.monotonic() + self.lease_wait_s
        delay = 0.05
        while True:
            entry = await self.cache.get(sid)
            if not resolution.needs_warm(entry, self.clock(), chash):
                return
            if await self.cache.try_lease(sid, self.replica):
                break
            if time.monotonic() > deadline:
                log.warning("mcp-warm-lease-wait-expired", server=sid)
                return
            await asyncio.sleep(delay)
            delay = min(delay * 1.6, 0.5)
        try:
            previous = await self.cache.get(sid)
            if not resolution.needs_warm(previous, self.clock(), chash):
                return
            await self._list_and_store(cfg, previous)
        finally:
            await self.cache.release(sid, self.replica)

    async def _list_and_store(self, cfg: McpServerConfig, previous: resolution.CacheEntry | None) -> None:
        sid, chash = cfg.id, cfg.connection_hash()
        with span("mcp.warm", **{"mcp.server": sid}):
            try:
                async with asyncio.timeout(self.settings.server_start_timeout_s):
                    tools = await self._list_tools(cfg)
                entry = resolution.ready_entry([wire_tool(cfg, t) for t in tools], self.clock(), chash)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure is the server's state, reported on resolve
                error = "warm-up timed out" if isinstance(exc, TimeoutError) else describe(exc)
                entry = resolution.failed_entry(previous if previous and previous.config == chash else None,
                                                error, self.clock(), chash)
                await self.drop_connection(sid)
            await self.cache.put(sid, entry)
            log.info("mcp-tools-listed", server=sid, status=entry.status.value, tools=len(entry.tools),
                     error=entry.error, replica=self.replica)
            if entry.status == Status.READY:
                await self._announce(sid, entry.fingerprint, len(entry.tools), "listed")
                if self.tool_vectors is not None and entry.tools:
                    # embed the new list now, so the first tool_search over it does not wait for the model
                    self._spawn(self._embed_tools(cfg.label, entry.tools), "mcp-embed-tools")

    async def _announce(self, sid: str, fingerprint: str | None, count: int, reason: str) -> None:
        """Publish ``ctx.mcp.tools_changed`` only when the server's tool list really changed (the registry's
        last announced fingerprint is the reference, so a lost cache does not cause a false change)."""
        changed, prev = await self.registry.announce(sid, fingerprint)
        if not changed:
            return
        log.info("mcp-tools-changed", server=sid, fingerprint=fingerprint, previous=prev, tools=count)
        if self.publish is not None:
            try:
                await self.publish({"serverId": sid, "fingerprint": fingerprint, "previousFingerprint": prev,
                                    "toolCount": count, "reason": reason, "at": self.clock()})
            except Exception as exc:  # noqa: BLE001 - a lost notification is not a failed warm-up
                log.warning("tools-changed-publish-failed", server=sid, error=describe(exc))

    async def _list_tools(self, cfg: McpServerConfig) -> list[mcp_types.Tool]:
        conn = await self._connection(cfg)
        try:
            return await conn.list_tools(self.settings.server_start_timeout_s)
        except ConnectionLost:
            # the old session died since its last use: one fresh session, then give up
            conn = await self._connection(cfg)
            return await conn.list_tools(self.settings.server_start_timeout_s)

    async def _await_warm(self, cfgs: Iterable[McpServerConfig], timeout: float) -> None:
        now = self.clock()
        tasks = []
        for cfg in cfgs:
            running = self._warming.get(cfg.id)
            if running is not None and not running.done():
                tasks.append(running)
                continue
            entry = await self.cache.get(cfg.id)
            if resolution.needs_warm(entry, now, cfg.connection_hash()):
                task = self.warm(cfg)
                # a non-empty ready list that is only due for a refresh is served while the refresh runs
                if not resolution.servable(entry, cfg.connection_hash()) or entry is None or not entry.tools:
                    tasks.append(task)
        if tasks and timeout > 0:
            await asyncio.wait(tasks, timeout=timeout)  # never cancels the shared warm-ups

    async def _warming_ids(self, sids: Iterable[str]) -> set[str]:
        out = set()
        for sid in sids:
            t = self._warming.get(sid)
            if (t is not None and not t.done()) or await self.cache.leased(sid):
                out.add(sid)
        return out

    # ---------- resolve ----------
    async def resolve(self, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            mode = resolution.normalize_mode(payload.get("mode"))
        except ValueError as exc:
            raise InvalidPayload(str(exc)) from exc
        servers = await self._servers()
        refs = [ServerRef(c.id, c.active, c.enabled) for c in servers.values()]
        selected = resolution.select_servers(mode, payload.get("serverIds"), refs)
        runnable = [servers[s] for s in selected if s in servers and servers[s].enabled]
        timeout = payload.get("warmTimeoutS")
        timeout = self.settings.warm_timeout_s if timeout is None else float(timeout)
        with span("mcp.resolve", **{"mcp.mode": mode, "mcp.servers": len(selected)}):
            await self._await_warm(runnable, timeout)
            entries = await self.cache.get_many([c.id for c in runnable])
            not_ready = [c.id for c in runnable if not resolution.servable(entries[c.id], c.connection_hash())]
            views = [ServerView(s, s in servers, servers[s].enabled if s in servers else True,
                                servers[s].connection_hash() if s in servers else "",
                                servers[s].label if s in servers else s) for s in selected]
            res = resolution.resolve(views, entries, await self._warming_ids(not_ready))
            tools = []
            for t in res.tools:
                cfg = servers[t["serverId"]]
                defer, approval, enabled = cfg.policy(t["name"])
                if enabled:
                    tools.append({**t, "namespace": cfg.label, "defer": defer, "approval": approval})
            reply: dict[str, Any] = {"mode": mode, "tools": tools, "servers": res.servers}
            dialect = payload.get("dialect")
            if dialect is not None:
                reply.update(await self._wire(tools, dialect, payload.get("contextWindow"), payload.get("turnId")))
            return reply

    async def _wire(self, tools: list[dict[str, Any]], dialect: schemas.Dialect, window: Any,
                    turn_id: str | None) -> dict[str, Any]:
        """Wire-safe tools for ``dialect`` and the deferral decision (SPEC §11)."""
        wired: list[tuple[dict[str, Any], dict[str, Any], schemas.WireReport]] = []
        for t in tools:
            wt, report = schemas.wire_tool(t["id"], t["description"], t["inputSchema"], dialect)
            wired.append((t, wt, report))
        costs = {t["id"]: wire_cost(t["id"], t["description"], wt["inputSchema"]) for t, wt, _ in wired}
        decision = deferral.decide([deferral.Candidate(t["id"], t["defer"], costs[t["id"]]) for t in tools], window)
        deferred = set(decision.deferred)
        wire_tools = [wt for t, wt, _ in wired if t["id"] not in deferred]
        reports = [r for t, _, r in wired if t["id"] not in deferred]
        deferred_tools = [t for t in tools if t["id"] in deferred]
        system_prompt = None
        spaces: list[dict[str, Any]] = []
        if deferred_tools:
            for m in meta.definitions(deferred_tools):
                wt, report = schemas.wire_tool(m["name"], m["description"], m["inputSchema"], dialect,
                                               m["inputExamples"])
                wire_tools.append(wt)
                reports.append(report)
            spaces = deferral.namespaces(deferred_tools)
            system_prompt = deferral.system_prompt_block(spaces)
            if turn_id:
                await self._store_turn(turn_id, dialect, deferred_tools)
        for t in tools:
            t["deferred"] = t["id"] in deferred
            t.pop("inputSchema", None)  # the wire carries what the model sees; tool_inspect shows the rest
        return {
            "wire": {"dialect": dialect, "tools": wire_tools, "systemPrompt": system_prompt,
                     "examplesDropped": sum(r.examples_dropped for r in reports),
                     "notStrict": [wt["name"] for wt in wire_tools if wt.get("strict") is False]},
            "deferral": {**decision.to_payload(), "namespaces": spaces},
        }

    async def _store_turn(self, turn_id: str, dialect: str, deferred_tools: list[dict[str, Any]]) -> None:
        ids = [t["id"] for t in deferred_tools]

        def fn(cur: dict[str, Any] | None) -> dict[str, Any]:
            inspected = [n for n in (cur or {}).get("inspected", []) if n in ids]
            return {"turnId": turn_id, "dialect": dialect, "deferred": ids,
                    "servers": list(dict.fromkeys(t["serverId"] for t in deferred_tools)),
                    "inspected": inspected}

        await self.turns.update(turn_id, fn)

    # ---------- invoke ----------
    async def _find(self, tid: str, servers: OrderedDict[str, McpServerConfig]) -> \
            tuple[McpServerConfig, dict[str, Any]] | None:
        candidates = [servers[s] for s in servers_for_id(tid, {c.id: c.label for c in servers.values()})
                      if servers[s].enabled]
        for attempt in range(2):
            entries = await self.cache.get_many([c.id for c in candidates])
            for c in candidates:
                e = entries[c.id]
                if resolution.servable(e, c.connection_hash()):
                    assert e is not None
                    for t in e.tools:
                        if t["id"] == tid:
                            return c, dict(t)
            if attempt == 0:
                await self._await_warm(candidates, self.settings.warm_timeout_s)
        entries = await self.cache.get_many([c.id for c in candidates])
        unready = {c.id: e for c, e in ((c, entries[c.id]) for c in candidates)
                   if not resolution.servable(e, c.connection_hash())}
        if unready:
            why = "; ".join(f"{sid}: {e.error if e and e.error else 'warming'}" for sid, e in unready.items())
            raise DependencyUnavailable(f"MCP tool {tid!r}: its server is not ready ({why})",
                                        details={"toolId": tid, "servers": sorted(unready)})
        return None

    async def invoke(self, tid: str, arguments: dict[str, Any], call_id: str | None,
                     timeout_s: float | None = None, turn_id: str | None = None) -> dict[str, Any]:
        if call_id and self._was_cancelled(call_id):
            return {"output": outputs.cancelled(), "cancelled": True}
        servers = await self._servers()
        hit = await self._find(tid, servers)
        if hit is None or not hit[0].policy(hit[1]["name"])[2]:
            raise NotFound(f"unknown MCP tool {tid!r}", details={"toolId": tid})
        cfg, tool = hit
        timeout = min(float(timeout_s or self.settings.call_timeout_s), self.settings.max_call_timeout_s)
        args = schemas.coerce_arguments(tool.get("inputSchema"), arguments)
        return await self._at_most_once(turn_id, call_id, tid, timeout,
                                        lambda: self._call(cfg, tool, args, call_id, timeout))

    async def _at_most_once(self, turn_id: str | None, call_id: str | None, tid: str, timeout: float,
                            run: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """Run a turn's tool call once: asked again (a runner resuming the turn after a crash), the recorded
        output answers, or the run still in flight is waited for — never a second run of the tool."""
        if self.runs is None or not (turn_id and call_id):
            return await run()
        key = run_key(turn_id, call_id)
        seen = await self.runs.begin(key, {"replica": self.replica, "startedAt": self.clock(), "toolId": tid})
        if seen is not None:
            return await self._earlier_run(key, seen, tid, call_id, timeout)
        result = await run()
        try:
            await self.runs.finish(key, result)
        except Exception as exc:  # noqa: BLE001 - the caller still gets the output; only a re-ask would miss it
            log.warning("tool-run-not-recorded", tool=tid, call_id=call_id, error=describe(exc))
        return result

    async def _earlier_run(self, key: str, entry: dict[str, Any], tid: str, call_id: str,
                           timeout: float) -> dict[str, Any]:
        """The output of a call already run (or still running, on this or another replica) for this turn."""
        deadline = self.clock() + timeout
        while entry.get("state") != "done" and self.clock() < deadline:
            await asyncio.sleep(RUN_POLL_S)
            entry = await self.runs.read(key) or entry
        if entry.get("state") == "done":
            log.info("tool-run-replayed", tool=tid, call_id=call_id)
            return entry["result"]
        log.warning("tool-run-unfinished", tool=tid, call_id=call_id, replica=entry.get("replica"))
        return {"output": outputs.error_text(
            f"the MCP tool call {call_id!r} was started before a restart and has not finished within {timeout:g} s; "
            "it is not run a second time (it may or may not have completed)"), "timedOut": True}

    async def _call(self, cfg: McpServerConfig, tool: dict[str, Any], args: dict[str, Any], call_id: str | None,
                    timeout: float) -> dict[str, Any]:
        sid, name = cfg.id, tool["name"]
        with span("mcp.invoke", **{"mcp.server": sid, "mcp.tool": name, "tool.call_id": call_id or ""}):
            try:
                conn = await self._connection(cfg)
            except Exception as exc:
                raise DependencyUnavailable(f"MCP server {sid!r} is not available: {describe(exc)}") from exc
            inner = asyncio.ensure_future(conn.call_tool(name, args, timeout))
            key = call_id or f"anon-{id(inner)}"
            self._calls.setdefault(key, set()).add(inner)
            try:
                result = await inner
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if inner.cancelled() and (current is None or not current.cancelling()):
                    log.info("mcp-call-cancelled", server=sid, tool=name, call_id=call_id)
                    return {"output": outputs.cancelled(), "cancelled": True}
                raise
            except ConnectionLost as exc:
                log.warning("mcp-call-connection-lost", server=sid, tool=name, call_id=call_id)
                return {"output": outputs.error_text(
                    f"the MCP server {sid!r} closed the connection during the call ({exc}); "
                    "the call may not have completed")}
            except TimeoutError:
                return {"output": outputs.error_text(
                    f"the MCP tool {name!r} did not answer within {timeout:g} s"), "timedOut": True}
            except MCPError as exc:
                return {"output": outputs.error_text(describe(exc))}
            except Exception as exc:  # noqa: BLE001 - e.g. the SDK rejecting the result shape
                log.warning("mcp-call-failed", server=sid, tool=name, error=describe(exc))
                return {"output": outputs.error_text(describe(exc))}
            finally:
                tasks = self._calls.get(key)
                if tasks is not None:
                    tasks.discard(inner)
                    if not tasks:
                        self._calls.pop(key, None)
            blocks = [b.model_dump(mode="json", by_alias=True, exclude_none=True) for b in result.content]
            return {"output": outputs.call_output(blocks, bool(result.is_error), result.structured_content)}

    # ---------- cancel ----------
    def cancel(self, call_id: str) -> int:
        """Cancel this replica's in-flight calls with ``call_id`` (and its inner ``<call_id>::…`` calls);
        remembered for a while so a call that starts after the cancel is refused."""
        now = time.monotonic()
        self._cancelled = {k: v for k, v in self._cancelled.items() if now - v < CANCEL_MEMORY_S}
        self._cancelled[call_id] = now
        n = 0
        for key, tasks in list(self._calls.items()):
            if key == call_id or key.startswith(call_id + "::"):
                for t in list(tasks):
                    if not t.done():
                        t.cancel()
                        n += 1
        return n

    def _was_cancelled(self, call_id: str) -> bool:
        now = time.monotonic()
        for key, at in self._cancelled.items():
            if now - at < CANCEL_MEMORY_S and (call_id == key or call_id.startswith(key + "::")):
                return True
        return False

    # ---------- meta-tools ----------
    async def meta(self, payload: dict[str, Any]) -> dict[str, Any]:
        turn_id, tool = payload["turnId"], payload["tool"]
        state = await self.turns.get(turn_id)
        if state is None:
            raise NotFound(f"no deferred tools recorded for turn {turn_id!r} (resolve with turnId and a dialect)",
                           details={"turnId": turn_id})
        args = schemas.coerce_arguments(meta.SCHEMAS[tool], payload.get("arguments") or {})
        errors = sorted(Draft202012Validator(meta.SCHEMAS[tool]).iter_errors(args), key=lambda e: str(e.path))
        if errors:
            return {"output": meta.error_output(
                f"{tool}: invalid arguments ({errors[0].message[:200]}); expected "
                + compact(meta.SCHEMAS[tool]))}
        servers = await self._servers()
        deferred_ids: list[str] = state["deferred"]
        catalog = await self._deferred_view(state, servers)
        with span("mcp.meta", **{"mcp.meta_tool": tool, "ctx.turn_id": turn_id}):
            if tool == meta.TOOL_SEARCH:
                index = await self._search_index(catalog)
                spaces = list(dict.fromkeys(t["namespace"] for t in catalog))
                limit = int(args.get("limit", meta.DEFAULT_LIMIT))
                if index.hybrid:  # the query's forward pass is CPU work: off the event loop
                    output = await asyncio.to_thread(meta.search_output, index, args["query"], limit, spaces)
                else:
                    output = meta.search_output(index, args["query"], limit, spaces)
                return {"output": output}
            name = args["name"]
            lookup = self._lookup(name, catalog, servers, await self.cache.get_many(state["servers"]))
            if tool == meta.TOOL_INSPECT:
                if name not in deferred_ids:
                    return {"output": meta.error_output(
                        f"tool_inspect: {name!r} is not one of this turn's deferred tools; use tool_search.")}
                if lookup.tool is None:
                    return {"output": meta.error_output(f"tool_inspect: the tool {name!r} no longer exists.")}
                await self._mark_inspected(turn_id, name)
                return {"output": meta.text_output(meta.signature(lookup.tool)), "inspected": [name]}
            verdict = meta.check_invoke(name, args.get("params"), deferred_ids, state.get("inspected", []), lookup)
            extra: dict[str, Any] = {}
            if verdict.inspected:
                await self._mark_inspected(turn_id, verdict.inspected)
                extra["inspected"] = [verdict.inspected]
            if verdict.output is not None:
                return {"output": verdict.output, **extra}
            assert verdict.tool is not None and verdict.params is not None
            inner = meta.inner_call_id(payload.get("callId"), name)
            if self._was_cancelled(inner):
                return {"output": outputs.cancelled(), "cancelled": True, "effectiveToolName": name, "callId": inner}
            cfg = servers[verdict.tool["serverId"]]
            timeout = min(float(payload.get("timeoutS") or self.settings.call_timeout_s),
                          self.settings.max_call_timeout_s)
            result = await self._at_most_once(turn_id, inner, name, timeout, lambda: self._call(
                cfg, dict(verdict.tool), verdict.params, inner, timeout))
            return {**result, "effectiveToolName": name, "callId": inner}

    async def _embed_tools(self, namespace: str, tools: list[dict[str, Any]]) -> None:
        if self.tool_vectors is None:
            return
        try:
            await self.tool_vectors.vectors(ranking.semantic_texts([{**t, "namespace": namespace} for t in tools]))
        except Exception as exc:  # noqa: BLE001 — tool_search embeds them when it needs them
            log.warning("tool-vectors-deferred", error=describe(exc))

    async def _search_index(self, tools: list[dict[str, Any]]) -> meta.SearchIndex:
        """One index per distinct deferred catalog (memoised, a few at a time); hybrid when the tool vectors
        can be had (memory, the shared cache, or embedded here), else lexical."""
        key = tuple((t["id"], fingerprint(t)) for t in tools)
        idx = self._indexes.get(key)
        if idx is not None:
            self._indexes.move_to_end(key)
            return idx
        vectors = None
        if self.tool_vectors is not None and tools:
            try:
                vectors = ranking.pool_views(await self.tool_vectors.vectors(ranking.semantic_texts(tools)))
            except Exception as exc:  # noqa: BLE001 — lexical ranking still answers
                log.warning("tool-vectors-unavailable", error=describe(exc))
        idx = meta.SearchIndex(tools, vectors, self.embedder.embed if vectors is not None else None)
        if vectors is not None or self.tool_vectors is None:  # a lexical stand-in is not kept: retry next time
            self._indexes[key] = idx
            while len(self._indexes) > 32:
                self._indexes.popitem(last=False)
        return idx

    async def _deferred_view(self, state: dict[str, Any], servers: OrderedDict[str, McpServerConfig]) -> \
            list[dict[str, Any]]:
        """The turn's deferred tools as they are in the catalog now, in the turn's order."""
        entries = await self.cache.get_many(state["servers"])
        by_id: dict[str, dict[str, Any]] = {}
        for sid, e in entries.items():
            if e is None or sid not in servers:
                continue
            for t in e.tools:
                by_id[t["id"]] = {**t, "namespace": servers[sid].label}
        return [by_id[i] for i in state["deferred"] if i in by_id]

    def _lookup(self, name: str, catalog: list[dict[str, Any]], servers: OrderedDict[str, McpServerConfig],
                entries: dict[str, resolution.CacheEntry | None]) -> meta.Lookup:
        tool = next((t for t in catalog if t["id"] == name), None)
        if tool is None:
            return meta.Lookup(None)
        cfg = servers.get(tool["serverId"])
        if cfg is None:
            return meta.Lookup(None)
        _, approval, enabled = cfg.policy(tool["name"])
        why = None
        if not cfg.enabled:
            why = f"the server {cfg.id!r} is disabled"
        elif not enabled:
            why = "the tool is disabled"
        elif not resolution.servable(entries.get(cfg.id), cfg.connection_hash()):
            e = entries.get(cfg.id)
            why = f"the server {cfg.id!r} is not ready ({e.error if e and e.error else 'warming'})"
        return meta.Lookup(tool, why, approval)

    async def _mark_inspected(self, turn_id: str, name: str) -> None:
        def fn(cur: dict[str, Any] | None) -> dict[str, Any] | None:
            if cur is None or name in cur.get("inspected", []):
                return cur
            return {**cur, "inspected": [*cur.get("inspected", []), name]}

        await self.turns.update(turn_id, fn)

    # ---------- registry ----------
    async def upsert_server(self, cfg: McpServerConfig) -> dict[str, Any]:
        record, created, prev = await self.registry.upsert(cfg)
        if prev is not None and prev.config.connection_hash() != cfg.connection_hash():
            await self.cache.delete(cfg.id)  # nobody serves the old list; the next resolve warms the new config
            await self.drop_connection(cfg.id)
        if prev is not None and not cfg.enabled:
            await self.drop_connection(cfg.id)
        if cfg.enabled and cfg.active:
            self.warm(cfg)
        return {"server": {**record.public(), **(await self._status_of([cfg.id]))[cfg.id]}, "created": created}

    async def remove_server(self, sid: str) -> dict[str, Any]:
        record = await self.registry.remove(sid)
        if record is None:
            return {"removed": False}
        entry = await self.cache.get(sid)
        await self.cache.delete(sid)
        await self.drop_connection(sid)
        if entry is not None and entry.fingerprint and self.publish is not None:
            try:
                await self.publish({"serverId": sid, "fingerprint": None, "previousFingerprint": entry.fingerprint,
                                    "toolCount": 0, "reason": "removed", "at": self.clock()})
            except Exception as exc:  # noqa: BLE001
                log.warning("tools-changed-publish-failed", server=sid, error=describe(exc))
        return {"removed": True}

    async def list_servers(self, ids: list[str] | None = None) -> dict[str, Any]:
        records = [r for r in await self._records() if ids is None or r.config.id in ids]
        status = await self._status_of([r.config.id for r in records], {r.config.id: r.config for r in records})
        return {"servers": [{**r.public(), **status[r.config.id]} for r in records]}

    async def _status_of(self, sids: list[str], cfgs: dict[str, McpServerConfig] | None = None) -> \
            dict[str, dict[str, Any]]:
        if cfgs is None:
            servers = await self._servers()
            cfgs = {s: servers[s] for s in sids if s in servers}
        entries = await self.cache.get_many(sids)
        warming = await self._warming_ids(sids)
        out: dict[str, dict[str, Any]] = {}
        for sid in sids:
            cfg, e = cfgs.get(sid), entries.get(sid)
            row: dict[str, Any] = {"toolCount": len(e.tools) if resolution.servable(e) else 0}
            if cfg is not None and not cfg.enabled:
                row["status"] = "disabled"
            elif cfg is not None and resolution.servable(e, cfg.connection_hash()):
                row["status"] = "ready"
            elif sid in warming:
                row["status"] = "warming"
            elif e is not None and e.status == Status.ERROR and (cfg is None or e.config == cfg.connection_hash()):
                row["status"] = "error"
                row["error"] = e.error or "unknown error"
            else:
                row["status"] = "cold"
            if e is not None and e.updated_at:
                row["checkedAt"] = e.updated_at
            out[sid] = row
        return out

    async def status(self) -> list[dict[str, Any]]:
        """Every registered server's state (for the /mcp/servers probe); ``cold`` = never warmed."""
        records = await self._records()
        st = await self._status_of([r.config.id for r in records], {r.config.id: r.config for r in records})
        return [{"id": r.config.id, "status": st[r.config.id]["status"], "tools": st[r.config.id]["toolCount"],
                 "active": r.config.active, **({"error": st[r.config.id]["error"]} if "error" in st[r.config.id]
                                                 else {})} for r in records]
