"""Authentication and tenants at the HTTP edge (SPEC §15.3).

Every call under ``/v1`` carries a credential — ``Authorization: Bearer <credential>`` or ``x-api-key: <key>`` —
and belongs to a tenant:

- **API keys** ``ctx_<keyId>_<secret>``. Issued keys are events in persistence's event store (stream
  ``apikey:<keyId>``: ApiKeyIssued then maybe ApiKeyRevoked; the index stream ``apikeys`` names every key): the
  edge stays stateless and Postgres keeps one owner. The event holds the secret's argon2id hash (argon2-cffi),
  never the secret; the key is shown once, in the creation reply. Lookup is by keyId, only the secret is verified.
  A successful verification is cached in-process for ``CTX_AUTH_CACHE_S`` seconds (sha256 of the secret compared
  in constant time), so a request does not pay a slow hash each time; a revocation is seen by every replica
  within that bound (at once on the replica that revoked). When the entry lapses the key's stream is read again
  (revoked → refused), but the same secret is not hashed again against the same stored hash: the slow hash is
  paid once per secret and replica, not once per cache period (one request in every period waited for it).
- **The bootstrap admin key** ``CTX_ADMIN_API_KEY`` (a secret setting, no default): admin scope (``/v1/keys``),
  and the tenant ``admin`` on conversation routes. Issued keys may carry the admin scope too.
- **OIDC/JWT bearer tokens** (optional, ``CTX_OIDC_JWKS_URL``): signature by a key of the JWKS (PyJWKClient),
  ``exp`` required, issuer and audience checked, the tenant named by the claim ``CTX_OIDC_TENANT_CLAIM``.

Missing or invalid credentials → 401 with ``WWW-Authenticate: Bearer``; a valid one without the admin scope on an
admin route → 403. Per-credential limits (settings, per-key overrides at creation): requests per second (a sliding
window counter, ``limits``) and concurrent running turns → 429 with ``Retry-After``. Both are counted per edge replica.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import jwt
import structlog
from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from ctxbuild_platform.errors import RemoteError
from fastapi import HTTPException, Request
from limits import RateLimitItemPerMinute, RateLimitItemPerSecond
from limits.aio.storage import MemoryStorage
from limits.aio.strategies import SlidingWindowCounterRateLimiter

from ..domain.keys import (
    ADMIN_TENANT,
    KEY_FORMAT,
    KEY_PREFIX,
    KEY_STREAM,
    TENANT_PATTERN,
    Principal,
    secret_digest,
)

log = structlog.get_logger("auth")

CHALLENGE = {"WWW-Authenticate": 'Bearer realm="ctxbuild"'}


@dataclass(frozen=True)
class AuthConfig:
    admin_key: str | None = None
    cache_s: float = 5.0
    requests_per_second: int = 50
    max_running_turns: int = 4
    # wrong secrets for one real key id, per minute and replica, before further tries are refused without hashing
    # (each try costs an argon2 hash; unknown key ids cost none). The key's owner is unaffected while cached.
    failed_verifications_per_minute: int = 30
    oidc_jwks_url: str | None = None
    oidc_issuer: str | None = None
    oidc_audience: str | None = None
    oidc_tenant_claim: str = "tenant"
    oidc_algorithms: tuple[str, ...] = ("RS256", "ES256")

    @classmethod
    def from_settings(cls, s: Any) -> AuthConfig:
        return cls(admin_key=s.admin_api_key.get_secret_value() if s.admin_api_key else None,
                   cache_s=s.auth_cache_s, requests_per_second=s.key_requests_per_second,
                   max_running_turns=s.key_max_running_turns,
                   failed_verifications_per_minute=s.key_failed_verifications_per_minute, oidc_jwks_url=s.oidc_jwks_url,
                   oidc_issuer=s.oidc_issuer, oidc_audience=s.oidc_audience,
                   oidc_tenant_claim=s.oidc_tenant_claim, oidc_algorithms=tuple(s.oidc_algorithms))


def unauthenticated(message: str) -> HTTPException:
    return HTTPException(401, message, headers=CHALLENGE)


def rate_limited(message: str, retry_after: int) -> HTTPException:
    return HTTPException(429, message, headers={"Retry-After": str(max(1, retry_after))})


def credential_of(request: Request) -> str | None:
    """The credential of a request: ``x-api-key``, else ``Authorization: Bearer``."""
    if (key := request.headers.get("x-api-key")) is not None:
        return key.strip()
    auth = request.headers.get("authorization")
    if auth is None:
        return None
    scheme, _, value = auth.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise unauthenticated("the Authorization header must be 'Bearer <API key or token>'")
    return value.strip()


@dataclass
class _Cached:
    digest: bytes
    principal: Principal
    until: float
    secret_hash: str  # the stored argon2 hash the secret was verified against


@dataclass
class Authenticator:
    """Verifies credentials (API keys through persistence's key streams, the admin key, JWTs) and applies the
    per-credential limits. ``read_stream(stream)`` returns a stream's events."""

    config: AuthConfig
    read_stream: Callable[[str], Awaitable[list[dict[str, Any]]]]
    hasher: PasswordHasher = field(default_factory=PasswordHasher)
    _cache: OrderedDict[str, _Cached] = field(default_factory=OrderedDict)
    # no thread on the request path: the thread-based storage starts a timer thread on most hits (its expiry sweep;
    # the event loop waits for it to start), and the asyncio one sweeps moving-window entries through the thread
    # pool — its counters (fixed and sliding windows) are swept in the loop
    _limiter: SlidingWindowCounterRateLimiter = field(
        default_factory=lambda: SlidingWindowCounterRateLimiter(MemoryStorage()))
    _running: dict[str, set[str]] = field(default_factory=dict)  # subject → turns it admitted on this replica
    _jwks: jwt.PyJWKClient | None = None

    def __post_init__(self) -> None:
        if self.config.oidc_jwks_url:
            self._jwks = jwt.PyJWKClient(self.config.oidc_jwks_url, cache_keys=True, lifespan=300, timeout=5)

    # ---------- verification ----------
    async def authenticate(self, credential: str | None) -> Principal:
        if not credential:
            raise unauthenticated("authentication required: send 'Authorization: Bearer <API key>' or "
                                  "'x-api-key: <API key>'")
        admin = self.config.admin_key
        if admin is not None and hmac.compare_digest(credential.encode(), admin.encode()):
            return Principal("admin", ADMIN_TENANT, admin=True)
        if credential.startswith(KEY_PREFIX):
            return await self._api_key(credential)
        if self._jwks is not None and credential.count(".") == 2:
            return await asyncio.to_thread(self._jwt, credential)
        raise unauthenticated("invalid credential")

    async def _api_key(self, key: str) -> Principal:
        m = KEY_FORMAT.match(key)
        if m is None:
            raise unauthenticated("invalid API key")
        key_id, secret = m.groups()
        digest, now = secret_digest(secret), time.monotonic()
        hit = self._cache.get(key_id)
        if hit is not None and hit.until > now and hmac.compare_digest(hit.digest, digest):
            return hit.principal
        try:
            events = await self.read_stream(KEY_STREAM + key_id)
        except RemoteError as exc:
            if exc.code == "not-found":
                events = []
            else:
                raise
        issued = next((e["data"] for e in events if e["type"] == "ApiKeyIssued"), None)
        if issued is None or any(e["type"] == "ApiKeyRevoked" for e in events):
            self._cache.pop(key_id, None)
            raise unauthenticated("invalid API key")  # unknown and revoked read the same
        failed = RateLimitItemPerMinute(self.config.failed_verifications_per_minute)
        # the secret this replica verified last for the key id (its cache entry outlives its trust) passes a flood
        # of wrong ones: the owner is never locked out by someone who knows only the key id
        known = hit is not None and hmac.compare_digest(hit.digest, digest)
        if not known and not await self._limiter.test(failed, "failed", key_id):
            raise rate_limited("too many failed verifications of this key id; try again later", 1)
        # a lapsed entry is trusted again only after the key is read (revocation above); its secret is hashed again
        # only when it is not the one this replica verified against this very hash
        if not (known and hit.secret_hash == issued["secretHash"]):
            try:
                await asyncio.to_thread(self.hasher.verify, issued["secretHash"], secret)
            except (VerificationError, InvalidHashError) as exc:
                await self._limiter.hit(failed, "failed", key_id)
                raise unauthenticated("invalid API key") from exc
        lim = issued.get("limits") or {}
        principal = Principal(f"key:{key_id}", issued["tenantId"], admin=bool(issued.get("admin")),
                              requests_per_second=lim.get("requestsPerSecond"),
                              max_running_turns=lim.get("maxRunningTurns"))
        self._cache[key_id] = _Cached(digest, principal, now + self.config.cache_s, issued["secretHash"])
        self._cache.move_to_end(key_id)
        while len(self._cache) > 10_000:
            self._cache.popitem(last=False)
        return principal

    def forget(self, key_id: str) -> None:
        """A key revoked on this replica stops working here at once."""
        self._cache.pop(key_id, None)

    def _jwt(self, token: str) -> Principal:
        c = self.config
        try:
            signing_key = self._jwks.get_signing_key_from_jwt(token)  # type: ignore[union-attr]
            claims = jwt.decode(token, signing_key.key, algorithms=list(c.oidc_algorithms), audience=c.oidc_audience,
                                issuer=c.oidc_issuer, options={"require": ["exp", "iss", "aud", "sub"]})
        except (jwt.PyJWTError, jwt.PyJWKClientError) as exc:
            raise unauthenticated(f"invalid bearer token: {type(exc).__name__}") from exc
        tenant = claims.get(c.oidc_tenant_claim)
        if not isinstance(tenant, str) or not re.match(TENANT_PATTERN, tenant) or len(tenant) > 128:
            raise unauthenticated(f"the token's '{c.oidc_tenant_claim}' claim does not name a tenant")
        return Principal(f"jwt:{claims['iss']}#{claims['sub']}", tenant)

    # ---------- hashing (issuing) ----------
    def hash_secret(self, secret: str) -> str:
        return self.hasher.hash(secret)

    # ---------- limits ----------
    async def check_rate(self, who: Principal) -> None:
        rps = who.requests_per_second or self.config.requests_per_second
        item = RateLimitItemPerSecond(rps)
        if not await self._limiter.hit(item, who.subject):
            reset, _ = await self._limiter.get_window_stats(item, who.subject)
            raise rate_limited(f"over {rps} requests per second for this credential",
                               math.ceil(reset - time.time()))

    async def admit_turn(self, who: Principal, turn_id: str, running: Callable[[str], Awaitable[bool]]) -> None:
        """Counts a new turn of the credential; 429 when it already has its maximum of running turns. The turns
        it holds are only asked whether they still run when it is at its limit (no reads per request below it)."""
        mine = self._running.setdefault(who.subject, set())
        most = who.max_running_turns or self.config.max_running_turns
        if len(mine) >= most:
            for t in list(mine):
                if not await running(t):
                    mine.discard(t)
        if len(mine) >= most:
            raise rate_limited(f"this credential already has {len(mine)} running turn(s), its limit is {most}; "
                               "wait for one to end", 1)
        mine.add(turn_id)

    def turn_not_started(self, who: Principal, turn_id: str) -> None:
        self._running.get(who.subject, set()).discard(turn_id)
