"""API keys and callers, pure (SPEC §15.3): the key format ``ctx_<keyId>_<secret>``, a new key, the digest a
verified secret is cached by, the streams issued keys live in, and who a caller is. The verification (argon2,
OIDC, the key streams, limits) is ``adapters/auth.py``."""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass

KEY_PREFIX = "ctx_"
KEY_STREAM = "apikey:"  # apikey:<keyId>: ApiKeyIssued, then maybe ApiKeyRevoked
KEY_INDEX = "apikeys"  # ApiKeyIndexed per issued key (listing)
ADMIN_TENANT = "admin"
LEGACY_TENANT = "default"  # a conversation created before tenants (no tenantId in ConversationCreated)
KEY_FORMAT = re.compile(r"^ctx_([0-9a-f]{16})_([A-Za-z0-9_-]{20,128})$")
TENANT_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.:-]*$"


def new_key() -> tuple[str, str, str]:
    """A fresh key: (keyId, secret, the key as the client sends it)."""
    key_id, secret = secrets.token_hex(8), secrets.token_urlsafe(32)
    return key_id, secret, f"{KEY_PREFIX}{key_id}_{secret}"


def secret_digest(secret: str) -> bytes:
    """What a verified secret is cached by (compared in constant time; never the secret itself)."""
    return hashlib.sha256(secret.encode()).digest()


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant its conversations belong to, and what limits apply."""

    subject: str  # key:<keyId>, admin, jwt:<iss>#<sub>
    tenant: str
    admin: bool = False
    requests_per_second: int | None = None  # None: the settings' default
    max_running_turns: int | None = None
