"""One long-lived MCP client session per server, over stdio or streamable HTTP, with the official SDK (``mcp`` 2.x
``Client``).

The SDK's client is an async context manager built on anyio task groups, which must be entered and exited by
the same task. So each connection has an *owner task* that enters the client, signals readiness and waits
until it is told to close; requests (``tools/list``, ``tools/call``) are sent from any task over the session.

A server process that dies is noticed on the next request (the SDK raises ``CONNECTION_CLOSED``): the
connection is then marked lost and the catalog opens a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import mcp_types
import structlog
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError

from ..settings import McpServerConfig

log = structlog.get_logger("mcp_session")

CLOSE_TIMEOUT_S = 8.0  # above the SDK's own bound on a stdio shutdown (its flush, SIGTERM and SIGKILL waits)
MAX_LIST_PAGES = 100


class ConnectionLost(Exception):
    """The session ended (server exited, pipe closed, or the connection was closed)."""


def describe(exc: BaseException) -> str:
    """A one-line message for any exception, exception groups (anyio task groups) unwrapped to their leaves."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(dict.fromkeys(describe(e) for e in exc.exceptions))
    if isinstance(exc, MCPError):
        return f"MCP error {exc.code}: {exc.message}"
    if isinstance(exc, ConnectionLost):
        return f"connection lost ({exc})"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _transport_closed(client: Client) -> bool:
    """Best-effort early notice that the server's stdout hit EOF (it exited), read from the SDK dispatcher's
    private state, so a dead session is replaced *before* a call is sent on it. Without that attribute
    (another SDK version) this says False and the CONNECTION_CLOSED error path still catches it."""
    try:
        return bool(getattr(client.session._dispatcher, "_closed", False))
    except Exception:  # noqa: BLE001
        return False


@contextlib.asynccontextmanager
async def http_transport(url: str, headers: dict[str, str] | None) -> AsyncIterator[Any]:
    """Streamable HTTP with our headers (the SDK's default client otherwise: MCP timeouts, same-origin
    redirects only)."""
    async with create_mcp_http_client(headers=headers or None) as http, \
            streamable_http_client(url, http_client=http) as streams:
        yield streams


class McpConnection:
    """A client session to one MCP server (stdio or streamable HTTP)."""

    def __init__(self, config: McpServerConfig, *, on_tools_changed: Callable[[], None] | None = None) -> None:
        self.server_id = config.id
        self.config_hash = config.connection_hash()
        self._config = config
        self._on_tools_changed = on_tools_changed
        self._client: Client | None = None
        self._owner: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self._lost: str | None = None

    @property
    def alive(self) -> bool:
        return (self._client is not None and self._lost is None and not self._closing.is_set()
                and not _transport_closed(self._client))

    @property
    def protocol_version(self) -> str | None:
        return self._client.protocol_version if self._client is not None else None

    async def open(self, timeout: float) -> None:
        """Spawn the server and complete the handshake, within ``timeout`` seconds (else close and raise)."""
        if self._owner is not None:
            raise RuntimeError("connection already opened")
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "exception not retrieved"
        self._owner = asyncio.create_task(self._own(ready), name=f"mcp-session-{self.server_id}")
        try:
            await asyncio.wait_for(asyncio.shield(ready), timeout)
        except BaseException:
            await self.close()
            raise

    async def _own(self, ready: asyncio.Future[None]) -> None:
        cfg = self._config
        server: Any
        if cfg.transport == "http":
            assert cfg.url is not None
            server = http_transport(cfg.url, cfg.headers)
        else:
            assert cfg.command is not None
            server = StdioServerParameters(command=cfg.command, args=list(cfg.args), env=cfg.env, cwd=cfg.cwd)
        client = Client(server, cache=None, message_handler=self._on_message)
        try:
            async with client:
                self._client = client
                if not ready.done():
                    ready.set_result(None)
                await self._closing.wait()
        except BaseException as exc:
            self._lost = describe(exc)
            if not ready.done():
                ready.set_exception(ConnectionLost(self._lost))
            if isinstance(exc, asyncio.CancelledError):
                raise
            log.warning("mcp-session-ended", server=self.server_id, error=self._lost)
        finally:
            self._client = None
            if self._lost is None:
                self._lost = "connection closed"
            if not ready.done():
                ready.set_exception(ConnectionLost(self._lost))

    async def _on_message(self, message: Any) -> None:
        if isinstance(message, mcp_types.ToolListChangedNotification) and self._on_tools_changed is not None:
            self._on_tools_changed()
        elif isinstance(message, Exception):
            log.warning("mcp-stream-error", server=self.server_id, error=describe(message))

    def _require(self) -> Client:
        client = self._client
        if client is None or not self.alive:
            raise ConnectionLost(self._lost or "connection is not open")
        return client

    def _lose(self, exc: MCPError) -> ConnectionLost:
        self._lost = describe(exc)
        return ConnectionLost(self._lost)

    async def list_tools(self, timeout: float) -> list[mcp_types.Tool]:
        """Every page of ``tools/list``."""
        client = self._require()
        tools: list[mcp_types.Tool] = []
        cursor: str | None = None
        try:
            async with asyncio.timeout(timeout):
                for _ in range(MAX_LIST_PAGES):
                    page = await client.list_tools(cursor=cursor, cache_mode="refresh")
                    tools.extend(page.tools)
                    cursor = page.next_cursor
                    if not cursor:
                        break
        except MCPError as exc:
            if exc.code == mcp_types.CONNECTION_CLOSED:
                raise self._lose(exc) from exc
            raise
        return tools

    async def call_tool(self, name: str, arguments: dict[str, Any], timeout: float) -> mcp_types.CallToolResult:
        """``tools/call``. Raises ConnectionLost, MCPError (a protocol-level error, e.g. unknown tool or
        invalid params) or TimeoutError; a tool's own failure is a result with ``is_error``."""
        client = self._require()
        try:
            async with asyncio.timeout(timeout + 1.0):
                return await client.call_tool(name, arguments, read_timeout_seconds=timeout)
        except MCPError as exc:
            if exc.code == mcp_types.CONNECTION_CLOSED:
                raise self._lose(exc) from exc
            if exc.code == mcp_types.REQUEST_TIMEOUT:
                raise TimeoutError(f"tools/call timed out after {timeout:g} s") from exc
            raise

    async def close(self) -> None:
        """Stop the session and the server process (bounded); idempotent."""
        self._closing.set()
        owner = self._owner
        if owner is None or owner.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(owner), CLOSE_TIMEOUT_S)
        except TimeoutError:
            owner.cancel()
            with contextlib.suppress(BaseException):
                await owner
        except BaseException as exc:  # noqa: BLE001 - closing never raises
            log.debug("mcp-session-close-error", server=self.server_id, error=describe(exc))
