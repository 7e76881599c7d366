"""The server registry in Postgres (schema ``mcp_catalog``): migrations (yoyo, at start-up), seeding from
``CTX_MCP_SERVERS``, CRUD, and the last announced tool-list fingerprint.

Seeding: an env server is written when it is new or when its env entry changed since it was last applied
(``seed_hash``), so an API edit survives restarts until the deployment changes that entry; an env-sourced row
whose id left ``CTX_MCP_SERVERS`` is removed. Replicas seed under one advisory lock.

If Postgres is unreachable after start-up, the last registry read is served (a resolve keeps working); writes
fail with ``unavailable``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import structlog
from ctxbuild_platform import migrations
from ctxbuild_platform.errors import DependencyUnavailable
from ctxbuild_platform.postgres import UNAVAILABLE, PostgresPool, postgres_errors

from ..settings import McpServerConfig

SCHEMA = "mcp_catalog"
MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
_LOCK_KEY = 0x6D63705F63617431  # "mcp_cat1": replicas seed the registry one at a time
log = structlog.get_logger("mcp_registry")


def plain_url(database_url: str) -> str:
    return migrations.plain_url(database_url)


async def apply_migrations(database_url: str, connect_timeout: float = 10.0) -> list[str]:
    return await migrations.apply_migrations(database_url, SCHEMA, MIGRATIONS_DIR, connect_timeout)


def seed_hash(cfg: McpServerConfig) -> str:
    return hashlib.sha256(json.dumps(cfg.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class ServerRecord:
    config: McpServerConfig
    source: str
    revision: int
    created_at: datetime | None = None
    updated_at: datetime | None = None
    tools_fingerprint: str | None = None

    def public(self) -> dict[str, Any]:
        out = {**self.config.public(), "source": self.source, "revision": self.revision}
        if self.updated_at is not None:
            out["updatedAt"] = self.updated_at.isoformat()
        return out


_COLUMNS = "config::text AS config, source, revision, created_at, updated_at, tools_fingerprint"


def _record(row: Any) -> ServerRecord:
    return ServerRecord(McpServerConfig.model_validate(json.loads(row["config"])), row["source"], row["revision"],
                        row["created_at"], row["updated_at"], row["tools_fingerprint"])


class Registry(PostgresPool):
    def __init__(self, database_url: str, *, min_size: int = 1, max_size: int = 5, timeout: float = 10.0) -> None:
        super().__init__(database_url, min_size=min_size, max_size=max_size, timeout=timeout)
        self._snapshot: list[ServerRecord] | None = None

    async def seed(self, servers: list[McpServerConfig]) -> dict[str, list[str]]:
        """Apply CTX_MCP_SERVERS (see the module doc). Returns what changed, for the log."""
        done: dict[str, list[str]] = {"inserted": [], "updated": [], "removed": []}
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK_KEY)
            rows = {r["id"]: r for r in await conn.fetch(
                f"SELECT id, source, seed_hash FROM {SCHEMA}.servers")}
            for cfg in servers:
                h = seed_hash(cfg)
                row = rows.get(cfg.id)
                if row is None:
                    await conn.execute(
                        f"INSERT INTO {SCHEMA}.servers (id, config, source, seed_hash) VALUES ($1, $2::jsonb, "
                        "'env', $3)", cfg.id, cfg.model_dump_json(), h)
                    done["inserted"].append(cfg.id)
                elif row["seed_hash"] != h:
                    await conn.execute(
                        f"UPDATE {SCHEMA}.servers SET config = $2::jsonb, source = 'env', seed_hash = $3, "
                        "revision = revision + 1, updated_at = now() WHERE id = $1", cfg.id, cfg.model_dump_json(), h)
                    done["updated"].append(cfg.id)
            keep = [c.id for c in servers]
            removed = await conn.fetch(
                f"DELETE FROM {SCHEMA}.servers WHERE source = 'env' AND NOT (id = ANY($1::text[])) RETURNING id",
                keep)
            done["removed"] = [r["id"] for r in removed]
        return done

    async def list(self) -> list[ServerRecord]:
        try:
            async with postgres_errors("postgres: registry unavailable"), \
                    self.pool.acquire(timeout=self.timeout) as conn:
                rows = await conn.fetch(f"SELECT {_COLUMNS} FROM {SCHEMA}.servers ORDER BY seq")
        except DependencyUnavailable as exc:
            if self._snapshot is not None:
                log.warning("registry-unavailable-serving-snapshot", error=str(exc)[:200])
                return list(self._snapshot)
            raise
        records = [_record(r) for r in rows]
        self._snapshot = records
        return records

    async def get(self, server_id: str) -> ServerRecord | None:
        for r in await self.list():
            if r.config.id == server_id:
                return r
        return None

    async def upsert(self, cfg: McpServerConfig) -> tuple[ServerRecord, bool, ServerRecord | None]:
        """(record, created, previous)."""
        async with postgres_errors("postgres: cannot write the registry"), \
                self.pool.acquire(timeout=self.timeout) as conn, conn.transaction():
            prev = await conn.fetchrow(f"SELECT {_COLUMNS} FROM {SCHEMA}.servers WHERE id = $1 FOR UPDATE", cfg.id)
            if prev is None:
                row = await conn.fetchrow(
                    f"INSERT INTO {SCHEMA}.servers (id, config, source) VALUES ($1, $2::jsonb, 'api') "
                    f"RETURNING {_COLUMNS}", cfg.id, cfg.model_dump_json())
            else:
                row = await conn.fetchrow(
                    f"UPDATE {SCHEMA}.servers SET config = $2::jsonb, source = 'api', revision = revision + 1, "
                    f"updated_at = now() WHERE id = $1 RETURNING {_COLUMNS}", cfg.id, cfg.model_dump_json())
        return _record(row), prev is None, (_record(prev) if prev is not None else None)

    async def remove(self, server_id: str) -> ServerRecord | None:
        async with postgres_errors("postgres: cannot write the registry"), \
                self.pool.acquire(timeout=self.timeout) as conn:
            row = await conn.fetchrow(f"DELETE FROM {SCHEMA}.servers WHERE id = $1 RETURNING {_COLUMNS}", server_id)
        return _record(row) if row is not None else None

    async def announce(self, server_id: str, fingerprint: str | None) -> tuple[bool, str | None]:
        """Record ``fingerprint`` as the server's announced tool list. (True, previous) only when it differs
        from what was announced before: the one caller that gets True publishes the change. Postgres out of reach
        → (False, None): nothing is announced (the next listing tries again)."""
        try:
            async with self.pool.acquire(timeout=self.timeout) as conn, conn.transaction():
                prev = await conn.fetchrow(
                    f"SELECT tools_fingerprint FROM {SCHEMA}.servers WHERE id = $1 FOR UPDATE", server_id)
                if prev is None or prev["tools_fingerprint"] == fingerprint:
                    return False, prev["tools_fingerprint"] if prev else None
                await conn.execute(f"UPDATE {SCHEMA}.servers SET tools_fingerprint = $2 WHERE id = $1",
                                   server_id, fingerprint)
                return True, prev["tools_fingerprint"]
        except UNAVAILABLE as exc:
            log.warning("announce-failed", server=server_id, error=str(exc)[:200])
            return False, None


class MemoryRegistry:
    """The same interface in memory (unit tests)."""

    def __init__(self, servers: list[McpServerConfig] | None = None) -> None:
        self._rows: dict[str, ServerRecord] = {}
        self._fps: dict[str, str | None] = {}
        for s in servers or []:
            self._rows[s.id] = ServerRecord(s, "env", 1)

    async def ping(self) -> bool:
        return True

    async def seed(self, servers: list[McpServerConfig]) -> dict[str, list[str]]:
        for s in servers:
            self._rows.setdefault(s.id, ServerRecord(s, "env", 1))
        return {"inserted": [], "updated": [], "removed": []}

    async def list(self) -> list[ServerRecord]:
        return list(self._rows.values())

    async def get(self, server_id: str) -> ServerRecord | None:
        return self._rows.get(server_id)

    async def upsert(self, cfg: McpServerConfig) -> tuple[ServerRecord, bool, ServerRecord | None]:
        prev = self._rows.get(cfg.id)
        rec = ServerRecord(cfg, "api", (prev.revision + 1) if prev else 1)
        self._rows[cfg.id] = rec
        return rec, prev is None, prev

    async def remove(self, server_id: str) -> ServerRecord | None:
        self._fps.pop(server_id, None)
        return self._rows.pop(server_id, None)

    async def announce(self, server_id: str, fingerprint: str | None) -> tuple[bool, str | None]:
        if server_id not in self._rows:
            return False, None
        prev = self._fps.get(server_id)
        if prev == fingerprint:
            return False, prev
        self._fps[server_id] = fingerprint
        return True, prev
