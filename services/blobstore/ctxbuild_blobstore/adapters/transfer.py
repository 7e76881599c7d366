"""The claim-check data channel: raw bytes between a caller's inbox and the one blob-store instance serving its
request, flow-controlled by NATS request/reply (see services/blobstore/README.md, "Large payloads").

- upload (pull): the instance handling ``ctx.blob.upload`` asks the caller's ``source`` inbox for chunk after
  chunk (``{"seq": n, "max": bytes}``); the reply is the raw chunk, an empty reply is the end, a reply with the
  ``Ctx-Blob-Error`` header aborts. At most ``window`` pulls are outstanding.
- download (push): the instance handling ``ctx.blob.get`` sends chunk after chunk to the caller's ``sink`` inbox
  as requests (header ``Ctx-Blob-Offset``); the caller's (empty) reply is the acknowledgement. At most ``window``
  chunks are unacknowledged, so a slow reader slows the S3 read instead of filling memory.

Every message stays under NATS ``max_payload`` (no base64): a pull asks for at most this instance's connection
``max_payload`` (the caller's client clamps the reply to its own); a push sends ``chunk_bytes`` (512 KiB) unless the
caller's get request offers a larger ``maxChunk`` (its connection's ``max_payload`` less room for headers), capped by
this instance's own ``max_payload`` less the same room. Fewer, larger messages: a 1 MiB blob is one pull reply, and
one large push plus a small tail, instead of two 512 KiB round trips. No instance keeps state between requests, so
replicas in one queue group need no stickiness.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator

import structlog
from ctxbuild_platform.errors import ServiceError
from faststream.nats import NatsBroker
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

log = structlog.get_logger("blobstore.transfer")

ERROR_HEADER = "Ctx-Blob-Error"
OFFSET_HEADER = "Ctx-Blob-Offset"
HEADER_ROOM = 4096  # bytes of a pushed message kept free for its headers (HPUB counts headers + payload)


def tune_nats_reads(size: int = 1024 * 1024) -> None:
    """nats-py reads its socket 32 KiB per event-loop turn (16 turns per 512 KiB chunk); 1 MiB per turn halves
    a chunk's latency. Process-wide, semantics unchanged; never lowers a larger setting."""
    import nats.aio.client as nats_client

    if getattr(nats_client, "DEFAULT_BUFFER_SIZE", 0) < size:
        nats_client.DEFAULT_BUFFER_SIZE = size


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def tune_malloc(mmap_threshold: int = 16 << 20, trim_threshold: int = 64 << 20) -> bool:
    """Keep large buffers in the heap instead of fresh mmaps. glibc serves every allocation over its mmap threshold
    (128 KiB at start) with a new mmap, so each 1 MiB chunk buffer — socket reads, the NATS parser, message
    payloads, S3 bodies, joins — is page-faulted in afresh and unmapped again: measured ~0.5 ms per 1 MiB copy in
    a VM, against ~0.03 ms for a copy into memory already mapped. With the thresholds raised, freed chunk
    buffers are reused (up to ``trim_threshold`` of free heap is kept). Process-wide; a no-op off glibc.
    Returns whether it applied."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, trim_threshold))
    except (OSError, AttributeError):
        return False


class TransferAborted(ServiceError):
    """The caller's side of a data channel went away, timed out or reported an error."""

    code = "transfer-aborted"
    retryable = True


class Transfer:
    def __init__(self, broker: NatsBroker, *, chunk_bytes: int, window: int, timeout_s: float) -> None:
        self.broker = broker
        self.chunk_bytes = chunk_bytes
        self.window = max(1, window)
        self.timeout_s = timeout_s
        self._tail: set[asyncio.Task] = set()  # unawaited acknowledgements of early-replied pushes

    def _tail_done(self, task: asyncio.Task) -> None:
        self._tail.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("push-tail-unacknowledged", error=str(task.exception())[:200])

    async def _request(self, subject: str, data: bytes, headers: dict[str, str] | None = None):
        try:
            return await self.broker.connection.request(subject, data, timeout=self.timeout_s, headers=headers)
        except NoRespondersError as exc:
            raise TransferAborted(f"nobody is listening on {subject}") from exc
        except (NatsTimeout, TimeoutError) as exc:
            raise TransferAborted(f"{subject} did not answer within {self.timeout_s:g}s") from exc

    def _max_payload(self) -> int:
        try:
            return int(self.broker.connection.max_payload or 0)
        except Exception:  # noqa: BLE001 - not connected (unit tests): the configured chunk size
            return 0

    @property
    def pull_bytes(self) -> int:
        """Largest chunk a pull asks for: a whole message of this connection (a pull reply carries no headers),
        never less than the configured chunk."""
        return max(self.chunk_bytes, self._max_payload())

    def push_bytes(self, offered: int | None) -> int:
        """Chunk size for a push: the configured chunk, or up to what the caller offered (its own max_payload less
        header room), never over this connection's max_payload less the same room."""
        if not offered:
            return self.chunk_bytes
        own = self._max_payload() - HEADER_ROOM
        return max(self.chunk_bytes, min(offered, own)) if own > 0 else self.chunk_bytes

    async def pull(self, source: str) -> AsyncIterator[bytes]:
        """The caller's bytes, chunk by chunk, until its empty reply."""
        pending: deque[asyncio.Task] = deque()
        seq = 0
        most = self.pull_bytes

        def ask() -> None:
            nonlocal seq
            body = json.dumps({"seq": seq, "max": most}).encode()
            pending.append(asyncio.ensure_future(self._request(source, body)))
            seq += 1

        try:
            for _ in range(self.window):
                ask()
            while True:
                msg = await pending.popleft()
                if msg.headers and ERROR_HEADER in msg.headers:
                    raise TransferAborted(f"the source reported: {msg.headers[ERROR_HEADER][:300]}",
                                          retryable=False)
                data = msg.data
                if not data:
                    return
                if len(data) > most:
                    raise TransferAborted(f"chunk of {len(data)} bytes is over the {most}-byte maximum",
                                          retryable=False)
                ask()
                yield data
        finally:
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    async def push(self, sink: str, chunks: AsyncIterator[bytes], offset: int, *, await_tail: bool = True) -> int:
        """Send every chunk to the caller's sink; returns how many were sent (all acknowledged, unless
        ``await_tail`` is False: then the last window's acknowledgements are not waited for — the caller asked
        for an early reply and reads up to the replied length itself)."""
        pending: deque[asyncio.Task] = deque()
        sent = acked = 0

        async def settle() -> None:
            nonlocal acked
            msg = await pending.popleft()
            if msg.headers and ERROR_HEADER in msg.headers:
                raise TransferAborted(f"the sink stopped: {msg.headers[ERROR_HEADER][:300]}", retryable=False)
            acked += 1

        try:
            async for chunk in chunks:
                if len(pending) >= self.window:
                    await settle()
                pending.append(asyncio.ensure_future(
                    self._request(sink, chunk, headers={OFFSET_HEADER: str(offset)})))
                offset += len(chunk)
                sent += 1
            if not await_tail:
                # the tail's requests finish (ack, or timeout) on their own; none is cancelled before it published
                for t in pending:
                    self._tail.add(t)
                    t.add_done_callback(self._tail_done)
                pending.clear()
                return sent
            while pending:
                await settle()
            return acked
        finally:
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
