"""The blob store as seen from the in-flight lane, through ``ctxbuild_blobclient.BlobClient``:

- ``put_provisional``: the full text with a ``provisional`` reference owned by the turn (GC cannot race the turn).
  The client picks the path: inline ``ctx.blob.put`` up to 768 KiB, the chunked ``ctx.blob.upload`` beyond (the
  sha256 is declared, so a text the conversation already holds costs no transfer). Any failure or timeout is an
  answer (None), never an exception: the caller falls back to the inline excerpt / the entity's full text.
- ``ref_provisional`` + ``stream``: a claimed output, already stored by the caller — the turn's provisional
  reference is added (this is also the access check: the conversation must already reference the blob) and the
  bytes stream back chunk by chunk (``ctx.blob.get``, sha256-verified by the client).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import structlog
from ctxbuild_blobclient import BlobClient

from ..domain import PutResult

log = structlog.get_logger("blobstore-adapter")
MIB = 1024 * 1024


class BlobStore:
    def __init__(self, client: BlobClient, timeout_s: float, timeout_per_mib_s: float = 2.0) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.timeout_per_mib_s = timeout_per_mib_s

    async def put_provisional(self, text: str, sha256: str | None, conversation_id: str,
                              turn_id: str) -> PutResult | None:
        """Store the full text; None on any failure (the caller falls back to inline — never fails the step)."""
        timeout = self.timeout_s + self.timeout_per_mib_s * (len(text) / MIB)
        try:
            reply = await asyncio.wait_for(
                self.client.put(text, conversation_id, ("turn", turn_id), "provisional", media_type="text/plain",
                                sha256=sha256),
                timeout)
            return PutResult(uri=str(reply["uri"]), sha256=str(reply["sha256"]))
        except Exception as exc:  # noqa: BLE001 - RemoteError, timeout, payload too large, malformed reply: all fall back
            log.warning("blob-put-failed", conversation_id=conversation_id, turn_id=turn_id,
                        error=f"{type(exc).__name__}: {exc}"[:300])
            return None

    async def ref_provisional(self, sha256: str, conversation_id: str, turn_id: str) -> dict:
        """The turn's provisional reference to a blob the conversation already references (RemoteError if not)."""
        return await self.client.ref(sha256, conversation_id, ("turn", turn_id), "provisional")

    def stream(self, sha256: str, conversation_id: str) -> AsyncIterator[bytes]:
        """The blob's bytes in order, bounded memory (the client's window of chunks); RemoteError on failure."""
        return self.client.iter_chunks(conversation_id, sha256=sha256)
