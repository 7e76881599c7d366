"""Names: S3 object keys, Postgres advisory-lock keys, and the transfer inboxes a caller may name."""

from __future__ import annotations

import re

BLOB_PREFIX = "blobs/"
UPLOAD_PREFIX = "uploads/"
_SHA = re.compile(r"^[0-9a-f]{64}$")
# a caller's data inbox (claim check); never a ctx.* service subject, never a wildcard
INBOX = re.compile(r"^_INBOX\.[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


def object_key(sha256: str) -> str:
    return BLOB_PREFIX + sha256


def temp_key(upload_id: str) -> str:
    return UPLOAD_PREFIX + upload_id


def sha_from_key(key: str) -> str | None:
    """``blobs/<sha256>`` → the sha256; anything else (a stray key) → None (never collected as a blob)."""
    if not key.startswith(BLOB_PREFIX):
        return None
    sha = key[len(BLOB_PREFIX):]
    return sha if _SHA.match(sha) else None


def is_sha256(value: str) -> bool:
    return bool(_SHA.match(value))


def lock_key(sha256: str) -> int:
    """The blob's Postgres advisory-lock key: the first 64 bits of its hash as a signed bigint. A collision
    between two blobs only makes one wait for the other (or GC skip a round), never a wrong result."""
    return int.from_bytes(bytes.fromhex(sha256[:16]), "big", signed=True)
