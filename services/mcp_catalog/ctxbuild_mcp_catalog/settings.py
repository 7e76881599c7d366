"""MCP catalog settings (env prefix ``CTX_``). ``CTX_MCP_SERVERS`` is a JSON list of server configs."""

from __future__ import annotations

import sys
from typing import Literal

from ctxbuild_platform.settings import ServiceSettings
from pydantic import BaseModel, ConfigDict, Field, model_validator


class McpServerConfig(BaseModel):
    """One MCP server. ``name`` (default: the id) makes the readable part of its tool ids."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=200)
    name: str = ""
    transport: Literal["stdio"] = "stdio"
    command: str = Field(min_length=1)
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] | None = Field(None, description="extra environment, over the SDK's safe defaults")
    cwd: str | None = None
    active: bool = Field(True, description="part of the `auto` pool and prewarmed at start-up")

    @property
    def label(self) -> str:
        return self.name or self.id


def default_servers() -> list[McpServerConfig]:
    """The reference time server (mcp-server-time), run with this interpreter."""
    return [McpServerConfig(id="time", name="time", command=sys.executable,
                            args=["-m", "mcp_server_time", "--local-timezone", "UTC"])]


class Settings(ServiceSettings):
    service_name: str = "mcp_catalog"
    mcp_servers: list[McpServerConfig] = Field(default_factory=default_servers,
                                               description="CTX_MCP_SERVERS: JSON list of MCP servers")
    warm_timeout_s: float = Field(10.0, ge=0, description="how long resolve/invoke await a cold server's warm-up")
    server_start_timeout_s: float = Field(
        30.0, gt=0, description="bound on one warm-up (spawn + handshake + tools/list); then the server is failed")
    call_timeout_s: float = Field(60.0, gt=0, description="bound on one tools/call")
    prewarm_concurrency: int = Field(3, ge=1, description="servers warmed at a time at start-up")

    @model_validator(mode="after")
    def _unique_ids(self) -> Settings:
        ids = [s.id for s in self.mcp_servers]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"duplicate MCP server ids: {dupes}")
        return self
