"""The claim-check data channel: raw bytes between a caller's inbox and the one blob-store instance serving its
request, flow-controlled by NATS request/reply (see services/blobstore/README.md, "Large payloads").

- upload (pull): the instance handling ``ctx.blob.upload`` asks the caller's ``source`` inbox for chunk after
  chunk (``{"seq": n, "max": bytes}``); the reply is the raw chunk, an empty reply is the end, a reply with the
  ``Ctx-Blob-Error`` header aborts. At most ``window`` pulls are outstanding.
- download (push): the instance handling ``ctx.blob.get`` sends chunk after chunk to the caller's ``sink`` inbox
  as requests (header ``Ctx-Blob-Offset``); the caller's (empty) reply is the acknowledgement. At most ``window``
  chunks are unacknowledged, so a slow reader slows the S3 read instead of filling memory.

Every message stays far under NATS ``max_payload`` (chunks ≤ 512 KiB, no base64), and no instance keeps state
between requests, so replicas in one queue group need no stickiness.
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


def tune_nats_reads(size: int = 1024 * 1024) -> None:
    """nats-py reads its socket 32 KiB per event-loop turn (16 turns per 512 KiB chunk); 1 MiB per turn halves
    a chunk's latency. Process-wide, semantics unchanged; never lowers a larger setting."""
    import nats.aio.client as nats_client

    if getattr(nats_client, "DEFAULT_BUFFER_SIZE", 0) < size:
        nats_client.DEFAULT_BUFFER_SIZE = size


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

    async def _request(self, subject: str, data: bytes, headers: dict[str, str] | None = None):
        try:
            return await self.broker.connection.request(subject, data, timeout=self.timeout_s, headers=headers)
        except NoRespondersError as exc:
            raise TransferAborted(f"nobody is listening on {subject}") from exc
        except (NatsTimeout, TimeoutError) as exc:
            raise TransferAborted(f"{subject} did not answer within {self.timeout_s:g}s") from exc

    async def pull(self, source: str) -> AsyncIterator[bytes]:
        """The caller's bytes, chunk by chunk, until its empty reply."""
        pending: deque[asyncio.Task] = deque()
        seq = 0

        def ask() -> None:
            nonlocal seq
            body = json.dumps({"seq": seq, "max": self.chunk_bytes}).encode()
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
                if len(data) > self.chunk_bytes:
                    raise TransferAborted(f"chunk of {len(data)} bytes is over the {self.chunk_bytes}-byte "
                                          "maximum", retryable=False)
                ask()
                yield data
        finally:
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    async def push(self, sink: str, chunks: AsyncIterator[bytes], offset: int) -> int:
        """Send every chunk to the caller's sink; returns how many were acknowledged."""
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
            while pending:
                await settle()
            return acked
        finally:
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
