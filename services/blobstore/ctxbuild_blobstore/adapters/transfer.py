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
import contextlib
import json
from collections.abc import AsyncIterator

import structlog
from ctxbuild_platform.errors import ServiceError
from faststream.nats import NatsBroker

log = structlog.get_logger("blobstore.transfer")

ERROR_HEADER = "Ctx-Blob-Error"
OFFSET_HEADER = "Ctx-Blob-Offset"
NO_RESPONDERS = "503"  # the server's status reply to a message nobody subscribes to
HEADER_ROOM = 4096  # bytes of a pushed message kept free for its headers (HPUB counts headers + payload)


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
        """The caller's bytes, chunk by chunk, until its empty reply. Pulls are published at once (no task in
        between), each with its own reply subject ``<inbox>.<seq>`` under this transfer's inbox; the replies are
        taken in sequence."""
        nc = self.broker.connection
        loop = asyncio.get_running_loop()
        inbox = nc.new_inbox()
        waiting: dict[int, asyncio.Future] = {}
        most = self.pull_bytes

        async def on_reply(msg) -> None:
            seq = msg.subject.rsplit(".", 1)[-1]
            fut = waiting.get(int(seq)) if seq.isdigit() else None
            if fut is not None and not fut.done():
                fut.set_result(msg)

        sub = await nc.subscribe(inbox + ".*", cb=on_reply)
        asked = taken = 0

        async def ask() -> None:
            nonlocal asked
            waiting[asked] = loop.create_future()
            await nc.publish(source, json.dumps({"seq": asked, "max": most}).encode(), reply=f"{inbox}.{asked}")
            asked += 1

        try:
            for _ in range(self.window):
                await ask()
            while True:
                try:
                    msg = await asyncio.wait_for(asyncio.shield(waiting[taken]), self.timeout_s)
                except TimeoutError as exc:
                    raise TransferAborted(f"{source} did not answer within {self.timeout_s:g}s") from exc
                del waiting[taken]
                taken += 1
                if msg.headers:
                    if msg.headers.get("Status") == NO_RESPONDERS:
                        raise TransferAborted(f"nobody is listening on {source}")
                    if ERROR_HEADER in msg.headers:
                        raise TransferAborted(f"the source reported: {msg.headers[ERROR_HEADER][:300]}",
                                              retryable=False)
                data = msg.data
                if not data:
                    return
                if len(data) > most:
                    raise TransferAborted(f"chunk of {len(data)} bytes is over the {most}-byte maximum",
                                          retryable=False)
                await ask()
                yield data
        finally:
            waiting.clear()
            with contextlib.suppress(Exception):  # a closed connection has no subscription left anyway
                await sub.unsubscribe()

    async def push(self, sink: str, chunks: AsyncIterator[bytes], offset: int, *, await_tail: bool = True) -> int:
        """Send every chunk to the caller's sink; returns how many were sent (all acknowledged, unless
        ``await_tail`` is False: then the last window's acknowledgements are not waited for — the caller asked
        for an early reply and reads up to the replied length itself).

        A chunk is published the moment it is read (no task in between: the caller gets it before this instance
        has even replied), its reply subject this transfer's own acknowledgement inbox. The caller acknowledges
        chunks in order, so acknowledgements are simply counted."""
        nc = self.broker.connection
        acks: asyncio.Queue = asyncio.Queue()

        async def on_ack(msg) -> None:
            acks.put_nowait(msg)

        sub = await nc.subscribe(nc.new_inbox(), cb=on_ack)
        sent = acked = 0

        async def settle() -> None:
            nonlocal acked
            try:
                msg = await asyncio.wait_for(acks.get(), self.timeout_s)
            except TimeoutError as exc:
                raise TransferAborted(f"{sink} did not acknowledge within {self.timeout_s:g}s") from exc
            if msg.headers:
                if msg.headers.get("Status") == NO_RESPONDERS:
                    raise TransferAborted(f"nobody is listening on {sink}")
                if ERROR_HEADER in msg.headers:
                    raise TransferAborted(f"the sink stopped: {msg.headers[ERROR_HEADER][:300]}", retryable=False)
            acked += 1

        try:
            async for chunk in chunks:
                while sent - acked >= self.window:
                    await settle()
                await nc.publish(sink, chunk, reply=sub.subject, headers={OFFSET_HEADER: str(offset)})
                offset += len(chunk)
                sent += 1
            if not await_tail:
                return sent  # acknowledgements still on their way are dropped by the server once we unsubscribe
            while acked < sent:
                await settle()
            return acked
        finally:
            with contextlib.suppress(Exception):  # a closed connection has no subscription left anyway
                await sub.unsubscribe()
