"""The blob-store calls of the persist lane (``ctx.blob.put`` / ``ref`` / ``release``, parts by content
reference), through ``ctxbuild_blobclient.BlobClient``, with retries of retryable failures."""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from ctxbuild_blobclient import BlobClient, content_ref
from ctxbuild_platform.errors import ServiceError
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from ..domain.persist_lane import BlobWrite
from .event_store import dumps

log = structlog.get_logger("persist_lane")
BLOB_ATTEMPTS = 3  # a blob-store call that fails retryably (S3 or the blob store away for a moment) is tried again


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, ServiceError) and bool(exc.retryable)


async def _again(call):
    """``call()`` with up to BLOB_ATTEMPTS attempts on retryable failures (short jittered backoff): a transient
    outage of the blob store costs a moment, not a part's trim or a message's content reference."""
    async for attempt in AsyncRetrying(retry=retry_if_exception(_retryable), stop=stop_after_attempt(BLOB_ATTEMPTS),
                                       wait=wait_exponential_jitter(initial=0.2, max=1.5), reraise=True):
        with attempt:
            return await call()
    raise AssertionError("unreachable")


class LaneBlobs:
    """The blob-store calls of the lane, through ``ctxbuild_blobclient.BlobClient`` (inline put, or the chunked
    upload for content over one NATS message), bounded in concurrency; failures are answers, not exceptions."""

    def __init__(self, client: BlobClient, *, concurrency: int) -> None:
        self.client = client
        self._slots = asyncio.Semaphore(concurrency)

    async def put(self, conversation_id: str, w: BlobWrite) -> str | None:
        """The URI the store acknowledged for exactly these bytes, or None (the part keeps its full text)."""
        async with self._slots:
            try:
                reply = await _again(lambda: self.client.put(w.text, conversation_id, ("message", w.message_id),
                                                             "tool_output", media_type="text/plain", sha256=w.sha256))
            except Exception as exc:  # noqa: BLE001 - any failure of one write only costs that part its trim
                log.warning("blob-put-failed", message=w.message_id, sha256=w.sha256,
                            error=f"{type(exc).__name__}: {exc}"[:300])
                return None
        if reply.get("sha256") != w.sha256:
            log.error("blob-put-mismatch", expected=w.sha256, got=reply.get("sha256"))
            return None
        return reply["uri"]

    async def ref(self, conversation_id: str, message_id: str, sha256: str) -> bool:
        async with self._slots:
            try:
                await _again(lambda: self.client.ref(sha256, conversation_id, ("message", message_id), "tool_output"))
                return True
            except Exception as exc:  # noqa: BLE001 - the provisional reference still holds the blob
                log.info("blob-ref-failed", message=message_id, sha256=sha256,
                         error=f"{type(exc).__name__}: {exc}"[:200])
                return False

    async def resolve_parts(self, conversation_id: str, message: dict[str, Any]) -> dict[str, Any]:
        """A message whose parts came by content reference, with the parts read back."""
        return await content_ref.resolve_message(self.client, message, conversation_id)

    async def small_parts(self, conversation_id: str, message: dict[str, Any], fits: int) -> dict[str, Any]:
        """The message with its parts by content reference when they are large (SPEC §15.1: events stay small);
        the blob is owned by the message (``tool_output``), like its trimmed outputs, so GC keeps it. The blob
        store failing keeps a message that still fits ``fits`` bytes inline (better fat than lost)."""
        async with self._slots:
            try:
                return await _again(lambda: content_ref.store_message_parts(
                    self.client, message, conversation_id, ("message", message["id"]), "tool_output"))
            except Exception as exc:
                if len(dumps(message).encode("utf-8", "surrogatepass")) <= fits:
                    log.warning("content-ref-skipped", message=message.get("id"),
                                error=f"{type(exc).__name__}: {exc}"[:200])
                    return message
                raise

    async def release(self, message_id: str, sha256: str | None = None) -> bool:
        try:
            await self.client.release(("message", message_id), "tool_output", sha256)
            return True
        except Exception as exc:  # noqa: BLE001 - the reference leaks (storage), nothing is lost
            log.warning("blob-release-failed", message=message_id, error=f"{type(exc).__name__}: {exc}"[:200])
            return False
