"""The tool cache shared by all replicas (NATS JetStream KV), warm-up leases and per-turn meta-tool state.

Buckets (created on first use, idempotently):
- ``ctx_mcp_tools``: one key per server, ``srv_<sha256(serverId)[:40]>`` → the CacheEntry JSON; and the tool
  vectors of tool_search, ``vec_<sha256(model id, text)[:40]>`` → float32 bytes (``ToolVectors``), so one replica
  embeds a catalog and the others read its vectors (the same vectors everywhere: the same ranking).
- ``ctx_mcp_leases``: one key per server while a replica warms it (single flight ACROSS replicas). Taken with
  ``create`` (fails when the key exists), released with a revision-checked delete; the bucket's max age (TTL)
  frees the lease of a replica that died while warming.
- ``ctx_mcp_turns``: ``turn_<sha256(turnId)[:40]>`` → the turn's deferral state (deferred tool ids, inspected
  names); updates are compare-and-set on the revision; the bucket's max age expires old turns.

In-memory twins with the same interface serve the unit tests.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import structlog
from ctxbuild_platform.claims import Claim
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from ..domain.resolution import CacheEntry

log = structlog.get_logger("mcp_cache")
CAS_RETRIES = 20


def server_key(server_id: str) -> str:
    return "srv_" + hashlib.sha256(server_id.encode()).hexdigest()[:40]


def vector_key(model_id: str, text: str) -> str:
    return "vec_" + hashlib.sha256(f"{model_id}\0{text}".encode()).hexdigest()[:40]


def turn_key(turn_id: str) -> str:
    return "turn_" + hashlib.sha256(turn_id.encode()).hexdigest()[:40]


def run_key(turn_id: str, call_id: str) -> str:
    """One tool call of one turn (call ids repeat across turns: a replayed script reuses them)."""
    return "run_" + hashlib.sha256(f"{turn_id}\x00{call_id}".encode()).hexdigest()[:40]


# a finished run's output up to this size is kept in the ledger entry itself; larger ones in the claim store
RUN_INLINE_MAX_BYTES = 256 * 1024


class KvBuckets:
    """Binds the three buckets lazily over the broker's NATS connection."""

    def __init__(self, connection: Callable[[], Any], *, tools: str, leases: str, turns: str,
                 lease_ttl_s: float, turn_ttl_s: float, replicas: int = 1) -> None:
        self._connection = connection
        self.replicas = replicas  # when this replica creates a bucket (3 on a three-node JetStream cluster)
        self.names = {"tools": tools, "leases": leases, "turns": turns}
        self.ttls = {"tools": None, "leases": lease_ttl_s, "turns": turn_ttl_s}
        self._kv: dict[str, Any] = {}
        self._lock = asyncio.Lock()

    async def get(self, which: str) -> Any:
        kv = self._kv.get(which)
        if kv is not None:
            return kv
        async with self._lock:
            if which not in self._kv:
                js = self._connection().jetstream()
                name = self.names[which]
                try:
                    kv = await js.create_key_value(bucket=name, history=1, ttl=self.ttls[which],
                                                   replicas=self.replicas,
                                                   description=f"ctxbuild mcp_catalog {which}")
                except BadRequestError:  # exists with another config (e.g. another TTL): use it as it is
                    kv = await js.key_value(name)
                self._kv[which] = kv
        return self._kv[which]

    async def value(self, which: str, key: str) -> bytes | None:
        """The key's value in bucket ``which``; None when the key is absent (or deleted: an empty value)."""
        kv = await self.get(which)
        try:
            e = await kv.get(key)
        except (KeyNotFoundError, NotFoundError):
            return None
        return e.value or None

    async def ping(self) -> bool:
        try:
            kv = await self.get("tools")
            await kv.status()
            return True
        except Exception:  # noqa: BLE001
            return False


class KvToolCache:
    def __init__(self, buckets: KvBuckets) -> None:
        self.b = buckets

    async def get(self, server_id: str) -> CacheEntry | None:
        value = await self.b.value("tools", server_key(server_id))
        return CacheEntry.from_json(value) if value else None

    async def get_many(self, server_ids: list[str]) -> dict[str, CacheEntry | None]:
        got = await asyncio.gather(*(self.get(s) for s in server_ids))
        return dict(zip(server_ids, got, strict=True))

    async def put(self, server_id: str, entry: CacheEntry) -> None:
        kv = await self.b.get("tools")
        await kv.put(server_key(server_id), entry.to_json())

    async def delete(self, server_id: str) -> None:
        kv = await self.b.get("tools")
        await kv.delete(server_key(server_id))

    async def mark_stale(self, server_id: str) -> None:
        kv = await self.b.get("tools")
        key = server_key(server_id)
        for _ in range(CAS_RETRIES):
            try:
                e = await kv.get(key)
            except (KeyNotFoundError, NotFoundError):
                return
            entry = CacheEntry.from_json(e.value)
            if entry.stale:
                return
            try:
                await kv.update(key, entry.with_stale().to_json(), last=e.revision)
                return
            except KeyWrongLastSequenceError:
                continue

    async def get_vector(self, key: str) -> bytes | None:
        return await self.b.value("tools", key)

    async def put_vector(self, key: str, value: bytes) -> None:
        kv = await self.b.get("tools")
        await kv.put(key, value)

    # ----- leases
    async def try_lease(self, server_id: str, owner: str) -> bool:
        kv = await self.b.get("leases")
        value = json.dumps({"owner": owner, "at": time.time()}).encode()
        try:
            await kv.create(server_key(server_id), value)
            return True
        except KeyWrongLastSequenceError:
            return False

    async def release(self, server_id: str, owner: str) -> None:
        kv = await self.b.get("leases")
        key = server_key(server_id)
        try:
            e = await kv.get(key)
        except (KeyNotFoundError, NotFoundError):
            return
        if e.value and json.loads(e.value).get("owner") == owner:
            try:
                await kv.delete(key, last=e.revision)
            except Exception as exc:  # noqa: BLE001 - the TTL frees it anyway
                log.warning("lease-release-failed", server=server_id, error=str(exc)[:200])

    async def leased(self, server_id: str) -> bool:
        return bool(await self.b.value("leases", server_key(server_id)))


class KvTurnStore:
    def __init__(self, buckets: KvBuckets) -> None:
        self.b = buckets

    async def get(self, turn_id: str) -> dict[str, Any] | None:
        value = await self.b.value("turns", turn_key(turn_id))
        return json.loads(value) if value else None

    async def update(self, turn_id: str, fn: Callable[[dict[str, Any] | None], dict[str, Any] | None]) -> \
            dict[str, Any] | None:
        """Read-modify-write with compare-and-set on the revision (concurrent tool calls of one step)."""
        kv = await self.b.get("turns")
        key = turn_key(turn_id)
        for _ in range(CAS_RETRIES):
            try:
                e = await kv.get(key)
                current, rev = (json.loads(e.value) if e.value else None), e.revision
            except (KeyNotFoundError, NotFoundError):
                current, rev = None, 0
            new = fn(current)
            if new is None or new == current:
                return current
            body = json.dumps(new, ensure_ascii=False, separators=(",", ":")).encode()
            try:
                if rev:
                    await kv.update(key, body, last=rev)
                else:
                    await kv.create(key, body)
                return new
            except KeyWrongLastSequenceError:
                continue
        raise RuntimeError(f"turn state {turn_id!r}: too much contention")


class KvRunLedger:
    """Which tool calls of a turn have run, and their outputs: a runner that died with a call in flight resumes
    the turn and asks again — the catalog answers from here instead of running the tool twice. Kept in the
    turns bucket (its TTL); an output too large for a KV value is kept in the claim store (its TTL)."""

    def __init__(self, buckets: KvBuckets, claim_store: Callable[[], Any]) -> None:
        self.b = buckets
        self._claims = claim_store

    async def begin(self, key: str, owner: dict[str, Any]) -> dict[str, Any] | None:
        """None: this caller owns the run now. Otherwise the entry already there (running or done)."""
        kv = await self.b.get("turns")
        body = json.dumps({"state": "running", **owner}, separators=(",", ":")).encode()
        for _ in range(CAS_RETRIES):
            try:
                await kv.create(key, body)
                return None
            except KeyWrongLastSequenceError:
                entry = await self.read(key)
                if entry is not None:
                    return entry
        raise RuntimeError(f"tool run {key!r}: too much contention")

    async def read(self, key: str) -> dict[str, Any] | None:
        value = await self.b.value("turns", key)
        if not value:
            return None
        entry = json.loads(value)
        if entry.get("state") == "done" and "claim" in entry:
            c = entry.pop("claim")
            data = await self._claims().take(Claim(c["key"], c["size"], c["sha256"], shared=True).checked())
            entry["result"] = json.loads(data)
        return entry

    async def finish(self, key: str, result: dict[str, Any]) -> None:
        kv = await self.b.get("turns")
        data = json.dumps(result, ensure_ascii=False, separators=(",", ":")).encode()
        if len(data) <= RUN_INLINE_MAX_BYTES:
            entry: dict[str, Any] = {"state": "done", "result": result}
        else:
            claim = await self._claims().put(data, shared=True)
            entry = {"state": "done", "claim": {"key": claim.key, "size": claim.size, "sha256": claim.sha256}}
        await kv.put(key, json.dumps(entry, ensure_ascii=False, separators=(",", ":")).encode())


class InMemoryToolCache:
    """The KV cache's interface in memory (unit tests, one process)."""

    def __init__(self) -> None:
        self._entries: dict[str, CacheEntry] = {}
        self._leases: dict[str, str] = {}
        self.vectors: dict[str, bytes] = {}

    async def get_vector(self, key: str) -> bytes | None:
        return self.vectors.get(key)

    async def put_vector(self, key: str, value: bytes) -> None:
        self.vectors[key] = value

    async def get(self, server_id: str) -> CacheEntry | None:
        return self._entries.get(server_id)

    async def get_many(self, server_ids: list[str]) -> dict[str, CacheEntry | None]:
        return {sid: self._entries.get(sid) for sid in server_ids}

    async def put(self, server_id: str, entry: CacheEntry) -> None:
        self._entries[server_id] = entry

    async def delete(self, server_id: str) -> None:
        self._entries.pop(server_id, None)

    async def mark_stale(self, server_id: str) -> None:
        e = self._entries.get(server_id)
        if e is not None:
            self._entries[server_id] = e.with_stale()

    async def try_lease(self, server_id: str, owner: str) -> bool:
        if server_id in self._leases:
            return False
        self._leases[server_id] = owner
        return True

    async def release(self, server_id: str, owner: str) -> None:
        if self._leases.get(server_id) == owner:
            del self._leases[server_id]

    async def leased(self, server_id: str) -> bool:
        return server_id in self._leases


class InMemoryTurnStore:
    def __init__(self) -> None:
        self._turns: dict[str, dict[str, Any]] = {}

    async def get(self, turn_id: str) -> dict[str, Any] | None:
        t = self._turns.get(turn_id)
        return json.loads(json.dumps(t)) if t is not None else None

    async def update(self, turn_id: str, fn: Callable[[dict[str, Any] | None], dict[str, Any] | None]) -> \
            dict[str, Any] | None:
        current = await self.get(turn_id)
        new = fn(current)
        if new is not None:
            self._turns[turn_id] = json.loads(json.dumps(new))
            return new
        return current


class ToolVectors:
    """The vectors of tool texts for tool_search: this replica's memory, else the shared tool cache, else
    embedded here (in a worker thread, the forward pass is CPU work) and stored in both."""

    def __init__(self, cache: Any, embedder: Any, max_entries: int = 8192) -> None:
        self.cache = cache
        self.embedder = embedder
        self.max_entries = max_entries
        self._memory: dict[str, np.ndarray] = {}
        self.computed = 0  # texts embedded by this replica (the others came from memory or the cache)

    async def vectors(self, texts: list[str]) -> np.ndarray:
        keys = [vector_key(self.embedder.model_id, t) for t in texts]
        missing = [k for k in dict.fromkeys(keys) if k not in self._memory]
        if missing:
            stored = await asyncio.gather(*(self.cache.get_vector(k) for k in missing))
            for k, raw in zip(missing, stored, strict=True):
                if raw is not None and len(raw) == 4 * self.embedder.dim:
                    self._remember(k, np.frombuffer(raw, dtype="<f4"))
            todo = [(k, t) for k, t in dict(zip(keys, texts, strict=True)).items() if k not in self._memory]
            if todo:
                fresh = await asyncio.to_thread(self.embedder.embed, [t for _, t in todo])
                self.computed += len(todo)
                for (k, _), row in zip(todo, fresh, strict=True):
                    self._remember(k, np.asarray(row, dtype="<f4"))
                results = await asyncio.gather(*(self.cache.put_vector(k, self._memory[k].tobytes())
                                                 for k, _ in todo), return_exceptions=True)
                failed = sum(isinstance(r, BaseException) for r in results)
                if failed:  # the next replica embeds them again; nothing else is lost
                    log.warning("tool-vectors-not-shared", failed=failed)
        return np.stack([self._memory[k] for k in keys]).astype(np.float32)

    def _remember(self, key: str, vector: np.ndarray) -> None:
        if len(self._memory) >= self.max_entries:
            self._memory.pop(next(iter(self._memory)))
        self._memory[key] = vector
