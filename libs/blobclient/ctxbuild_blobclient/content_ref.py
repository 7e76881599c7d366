"""Content by reference: a JSON value too large to travel inside an event is stored as one content-addressed
blob, and the event holds a small reference instead (SPEC §15.1: events stay small).

The reference is ``{"contentRef": {"uri", "sha256", "size", "mediaType"}}`` (``contracts/model/content-ref.json``).
The blob's bytes are the value as compact JSON with the key order it had, so the same value always gives the same
blob (and an identical checkpoint or message costs nothing the second time). Readers call :func:`resolve` on any
value that may be a reference; anything else passes through unchanged.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, Protocol

REF_KEY = "contentRef"
MEDIA_TYPE = "application/json"
INLINE_MAX_BYTES = 16 * 1024  # a value at most this large stays inline in its event


class BlobPort(Protocol):  # what BlobClient offers; tests pass an in-memory double
    async def put(self, content: Any, conversation_id: str, owner: Any, role: str, *,
                  media_type: str | None = None) -> dict[str, Any]: ...

    async def get_bytes(self, conversation_id: str, *, sha256: str | None = None,
                        uri: str | None = None) -> bytes: ...


def encode(value: Any) -> bytes:
    """The value's JSON bytes as stored in a reference blob (compact, key order kept, UTF-8)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def is_ref(value: Any) -> bool:
    return isinstance(value, Mapping) and set(value) == {REF_KEY} and isinstance(value[REF_KEY], Mapping)


async def _store(blobs: BlobPort, body: bytes, conversation_id: str, owner: Any, role: str) -> dict[str, Any]:
    """Store the encoded value as a JSON blob with one reference (owner, role); returns the ``contentRef`` object."""
    r = await blobs.put(body, conversation_id, owner, role, media_type=MEDIA_TYPE)
    return {REF_KEY: {"uri": r["uri"], "sha256": r["sha256"], "size": r["size"], "mediaType": MEDIA_TYPE}}


async def store_if_large(blobs: BlobPort, value: Any, conversation_id: str, owner: Any, role: str,
                         limit: int = INLINE_MAX_BYTES) -> Any:
    """``value`` itself when it fits ``limit`` bytes of JSON, else a reference to it (encoded once)."""
    body = encode(value)
    if len(body) <= limit:
        return value
    return await _store(blobs, body, conversation_id, owner, role)


async def resolve(blobs: BlobPort, value: Any, conversation_id: str) -> Any:
    """The value a reference stands for (checked against its sha256); a non-reference is returned as is."""
    if not is_ref(value):
        return value
    ref = value[REF_KEY]
    body = await blobs.get_bytes(conversation_id, sha256=ref["sha256"])
    if hashlib.sha256(body).hexdigest() != ref["sha256"]:
        raise ValueError(f"content reference {ref['uri']}: the blob's bytes do not match its sha256")
    return json.loads(body)


async def store_message_parts(blobs: BlobPort, message: dict[str, Any], conversation_id: str, owner: Any,
                              role: str, limit: int = INLINE_MAX_BYTES) -> dict[str, Any]:
    """The message with its ``parts`` stored by reference when they are over ``limit`` bytes of JSON
    (``contracts/model/message.json``: parts is an array, or a content reference in a stored event)."""
    parts = message.get("parts")
    if parts is None or is_ref(parts):
        return message
    stored = await store_if_large(blobs, parts, conversation_id, owner, role, limit)
    return message if stored is parts else {**message, "parts": stored}


async def resolve_message(blobs: BlobPort, message: dict[str, Any], conversation_id: str) -> dict[str, Any]:
    """The message with referenced parts read back; a message with inline parts is returned as is."""
    parts = message.get("parts")
    if not is_ref(parts):
        return message
    return {**message, "parts": await resolve(blobs, parts, conversation_id)}
