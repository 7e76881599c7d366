"""Claim check for every NATS message the platform sends: a payload over the inline limit is stored in a JetStream
Object Store bucket and the message carries only its claim.

- Request or published message: the body is empty and the header ``Ctx-Claim`` names the claim
  (``key=…;size=…;sha256=…``, plus ``;shared=1`` for a message several consumers may read). Subjects' request
  contracts are unchanged: the receiver resolves the claim before validation.
- Reply: the body is the claim form ``{"claim": {key, size, sha256}}`` (``contracts/common/reply.json``).
- A point-to-point claim (request, reply) is deleted by its reader once read; a shared one (broadcast, work queue
  that may redeliver) is left to the bucket's TTL, which is also the backstop for every claim nobody read.
- Every read checks size and sha256 against the claim. A gone claim is ``claim-missing``, a mismatch
  ``claim-corrupt``, an unreachable store ``unavailable`` — all typed and retryable, never ``internal``.

The inline limit is the connection's ``max_payload`` (what the server announced, 1 MB by default) minus headroom
for headers, unless configured lower (``CTX_MESSAGE_INLINE_MAX_BYTES``, for tests and for keeping messages small).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import uuid
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import structlog
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js import api
from nats.js.errors import BadRequestError, DigestMismatchError, NotFoundError
from nats.js.object_store import ObjectStore

from .errors import ClaimCorrupt, ClaimMissing, DependencyUnavailable, InvalidPayload, ServiceError
from .telemetry import span

CLAIM_HEADER = "Ctx-Claim"
# content type of a message whose body is empty and whose payload is claimed: not JSON, so FastStream's default
# decoder leaves the (empty) body alone instead of failing to parse it
CLAIM_CONTENT_TYPE = "application/vnd.ctxbuild.claim"
HEADROOM_BYTES = 16 * 1024  # headers (trace context, FastStream's own, the claim) on top of the body
CHUNK_BYTES = 512 * 1024  # object chunk size: fewer acknowledged publishes than the library's 128 KiB default
log = structlog.get_logger("claims")


@dataclass(frozen=True)
class ClaimConfig:
    bucket: str = "CTX_CLAIMS"
    max_age_s: float = 3600.0  # TTL of every claim; readers delete point-to-point claims at once
    replicas: int = 1
    inline_max_bytes: int | None = None  # None: the connection's max_payload minus HEADROOM_BYTES
    timeout_s: float = 30.0  # one store operation (a read of a large payload included)

    @classmethod
    def from_settings(cls, settings: Any) -> ClaimConfig:
        return cls(bucket=settings.claims_bucket, max_age_s=settings.claims_max_age_s,
                   replicas=settings.claims_replicas, inline_max_bytes=settings.message_inline_max_bytes,
                   timeout_s=settings.claims_timeout_s)


_config = ClaimConfig()


def configure(config: ClaimConfig) -> None:
    """The process's claim settings (service start-up; tests that want a tiny inline limit)."""
    global _config
    _config = config


def config() -> ClaimConfig:
    return _config


def encode_json(value: Any) -> bytes:
    """Compact UTF-8 JSON; a string with a lone surrogate (not encodable as UTF-8) is sent \\u-escaped instead."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        return json.dumps(value, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Claim:
    key: str
    size: int
    sha256: str
    shared: bool = False  # several readers may need it: nobody deletes it, the TTL does

    @classmethod
    def of(cls, data: bytes, *, shared: bool = False) -> Claim:
        return cls(uuid.uuid4().hex, len(data), hashlib.sha256(data).hexdigest(), shared)

    def header(self) -> str:
        return f"key={self.key};size={self.size};sha256={self.sha256}" + (";shared=1" if self.shared else "")

    @classmethod
    def from_header(cls, value: str) -> Claim:
        try:
            fields = dict(item.split("=", 1) for item in value.split(";"))
            claim = cls(fields["key"], int(fields["size"]), fields["sha256"], fields.get("shared") == "1")
        except (ValueError, KeyError) as exc:
            raise InvalidPayload(f"malformed {CLAIM_HEADER} header: {value[:200]!r}") from exc
        return claim.checked()

    def reply_form(self) -> dict[str, Any]:
        return {"claim": {"key": self.key, "size": self.size, "sha256": self.sha256}}

    @classmethod
    def from_reply(cls, form: Any) -> Claim:
        try:
            claim = cls(str(form["key"]), int(form["size"]), str(form["sha256"]))
        except (TypeError, ValueError, KeyError) as exc:
            raise InvalidPayload(f"malformed claim in reply: {str(form)[:200]}") from exc
        return claim.checked()

    def checked(self) -> Claim:
        if not self.key or self.size < 0 or len(self.sha256) != 64:
            raise InvalidPayload(f"malformed claim: {self.header()[:200]}")
        return self


class ClaimStore:
    """The claim bucket over one NATS connection, created (or bound) on first use."""

    def __init__(self, connection: Client) -> None:
        self._nc = connection
        self._bound: tuple[str, ObjectStore] | None = None
        self._lock = asyncio.Lock()

    def inline_limit(self) -> int:
        cfg = _config
        limit = self._nc.max_payload - HEADROOM_BYTES
        return min(limit, cfg.inline_max_bytes) if cfg.inline_max_bytes is not None else limit

    async def bucket(self) -> ObjectStore:
        cfg = _config
        if self._bound is not None and self._bound[0] == cfg.bucket:
            return self._bound[1]
        async with self._lock:
            if self._bound is None or self._bound[0] != cfg.bucket:
                with _store_errors("open"):
                    js = self._nc.jetstream(timeout=cfg.timeout_s)
                    try:  # idempotent: the same config from another replica is not an error
                        obs = await js.create_object_store(cfg.bucket, config=api.ObjectStoreConfig(
                            description="ctxbuild claim checks: message payloads over the inline limit",
                            ttl=cfg.max_age_s, storage=api.StorageType.FILE, replicas=cfg.replicas))
                    except BadRequestError:  # exists with another config (e.g. another TTL): use it as it is
                        obs = await js.object_store(cfg.bucket)
                self._bound = (cfg.bucket, obs)
        return self._bound[1]

    async def put(self, data: bytes, *, shared: bool = False) -> Claim:
        claim = Claim.of(data, shared=shared)
        obs = await self.bucket()
        chunk = max(1024, min(CHUNK_BYTES, self._nc.max_payload - HEADROOM_BYTES))
        with span("claim put", **{"claim.size": claim.size}), _store_errors("put"):
            await asyncio.wait_for(obs.put(claim.key, data, meta=api.ObjectMeta(
                name=claim.key, options=api.ObjectMetaOptions(max_chunk_size=chunk))), _config.timeout_s)
        return claim

    async def take(self, claim: Claim) -> bytes:
        """The claimed bytes, verified; a point-to-point claim is deleted once read."""
        obs = await self.bucket()
        sink = io.BytesIO()  # written chunk by chunk (the library's in-memory result grows by concatenation)
        with span("claim get", **{"claim.size": claim.size}), _store_errors("get"):
            try:
                await asyncio.wait_for(obs.get(claim.key, writeinto=sink), _config.timeout_s)
            except NotFoundError as exc:
                raise ClaimMissing(f"claim {claim.key} is gone (expired after {_config.max_age_s:g} s, "
                                   "or already read)") from exc
            except DigestMismatchError as exc:
                raise ClaimCorrupt(f"claim {claim.key}: stored chunks do not match their digest") from exc
        data = sink.getvalue()
        if len(data) != claim.size or hashlib.sha256(data).hexdigest() != claim.sha256:
            raise ClaimCorrupt(f"claim {claim.key}: read {len(data)} bytes, not the {claim.size} bytes "
                               "and sha256 it names")
        if not claim.shared:
            await self.delete(claim)
        return data

    async def delete(self, claim: Claim) -> None:
        """Best effort: the TTL removes whatever is left."""
        try:
            obs = await self.bucket()
            await asyncio.wait_for(obs.delete(claim.key), _config.timeout_s)
        except (NotFoundError, ServiceError, NatsError, TimeoutError) as exc:
            log.warning("claim-not-deleted", key=claim.key, error=f"{type(exc).__name__}: {exc}"[:300])

    # ------------------------------------------------------------------------------------- message forms
    async def outgoing(self, body: bytes, *, shared: bool) -> tuple[bytes, dict[str, str]]:
        """The body to send and the headers to add: the body itself, or nothing and the claim header."""
        if len(body) <= self.inline_limit():
            return body, {}
        claim = await self.put(body, shared=shared)
        return b"", claim_headers(claim)

    async def incoming(self, body: bytes, headers: Mapping[str, str] | None) -> bytes:
        """The message's real body: the claimed bytes when the message names a claim."""
        value = (headers or {}).get(CLAIM_HEADER)
        if value is None:
            return body
        return await self.take(Claim.from_header(value))

    async def reply(self, envelope: dict[str, Any]) -> bytes:
        return await self.reply_bytes(encode_json(envelope))

    async def reply_bytes(self, body: bytes) -> bytes:
        """An encoded reply envelope as it goes on the wire: itself, or its claim form when over the limit. A
        reply that cannot be stored becomes a typed ``unavailable`` error (the caller may retry)."""
        if len(body) <= self.inline_limit():
            return body
        try:
            claim = await self.put(body)
        except ServiceError as exc:
            log.warning("reply-not-claimed", size=len(body), code=exc.code, error=exc.message)
            return encode_json({"error": exc.to_payload()})
        return encode_json(claim.reply_form())

    async def open_reply(self, body: bytes) -> Any:
        """A reply envelope as the server meant it: the claim form resolved."""
        reply = decode(body)
        if isinstance(reply, dict) and "claim" in reply:
            reply = decode(await self.take(Claim.from_reply(reply["claim"])))
        return reply


def claim_headers(claim: Claim) -> dict[str, str]:
    return {CLAIM_HEADER: claim.header(), "content-type": CLAIM_CONTENT_TYPE}


def decode(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidPayload(f"payload is not JSON: {exc}") from exc


@contextmanager
def _store_errors(what: str) -> Iterator[None]:
    """The store's failures as typed errors: anything the NATS client raises is ``unavailable`` (retryable)."""
    try:
        yield
    except ServiceError:
        raise
    except (NatsError, TimeoutError, OSError) as exc:
        raise DependencyUnavailable(f"claim store {what}: {type(exc).__name__}: {exc}"[:500]) from exc


_stores: weakref.WeakKeyDictionary[Client, ClaimStore] = weakref.WeakKeyDictionary()


def store(connection: Client) -> ClaimStore:
    """The claim store of a NATS connection (one per connection, shared by every caller in the process)."""
    s = _stores.get(connection)
    if s is None:
        s = _stores[connection] = ClaimStore(connection)
    return s


def store_for(broker: Any) -> ClaimStore:
    """The claim store of a connected FastStream broker."""
    return store(broker.connection)


async def message_body(broker: Any, message: Any) -> bytes:
    """A FastStream message's real body, for subscribers that do not go through ``rpc``."""
    return await store_for(broker).incoming(message.body, message.headers)


async def answer(broker: Any, message: Any, handle: Callable[[bytes], Awaitable[bytes]]) -> bytes:
    """A request/reply subscriber's wire work around its handler (bytes in, encoded reply envelope out): a
    claimed request is resolved first (a gone or damaged claim is answered as its typed error), a reply over the
    inline limit goes back in its claim form. ``message``: a FastStream message."""
    return await answer_raw(store_for(broker), message.body, message.headers,
                            getattr(message, "subject", None), handle)


async def answer_raw(store: ClaimStore, body: bytes, headers: Mapping[str, str] | None, subject: str | None,
                     handle: Callable[[bytes], Awaitable[bytes]]) -> bytes:
    """:func:`answer` for a message taken apart (a plain nats-py message: ``data``, ``headers``, ``subject``)."""
    try:
        raw = await store.incoming(body, headers)
    except ServiceError as exc:
        log.info("claim-not-resolved", subject=subject, code=exc.code, error=exc.message)
        return encode_json({"error": exc.to_payload()})
    return await store.reply_bytes(await handle(raw))


async def publish(broker: Any, subject: str, payload: Any, *, headers: Mapping[str, str] | None = None) -> None:
    """Publish on core NATS with claim check: a JSON payload (or bytes) over the inline limit goes by claim.
    Published messages may have several readers (broadcasts), so the claim is shared and left to the TTL."""
    body = payload if isinstance(payload, bytes) else encode_json(payload)
    body, extra = await store_for(broker).outgoing(body, shared=True)
    await broker.publish(body, subject, headers={"content-type": "application/json", **(headers or {}), **extra})


def with_config(**changes: Any) -> ClaimConfig:
    """The current config with some fields changed (tests: ``configure(with_config(inline_max_bytes=512))``)."""
    return replace(_config, **changes)
