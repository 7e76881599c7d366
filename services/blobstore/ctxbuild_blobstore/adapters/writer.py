"""Streaming an upload into S3 with bounded memory.

Bytes are buffered up to one part (``part_bytes``, ≥ 5 MiB as S3 requires). An upload that ends inside its first
part becomes a single PUT straight to ``blobs/<sha256>`` (the hash is known by then). A larger one becomes a
multipart upload, at most one part in flight while the next fills; it is completed only after the content hash
has been verified, so a half-written or wrong object is never visible:
- the caller declared the sha256 → the multipart upload targets ``blobs/<sha256>`` directly;
- it did not → it targets a staging key ``uploads/<id>``, then a server-side copy to ``blobs/<sha256>`` and the
  staging object is removed.
An upload that fails is aborted; one whose process died is aborted by the collector after ``upload_stale_s``.
"""

from __future__ import annotations

import asyncio

import structlog
from minio.datatypes import Part

from .s3 import ObjectStore

log = structlog.get_logger("blobstore.writer")


class ObjectWriter:
    def __init__(self, s3: ObjectStore, key: str, part_bytes: int, *, store: bool = True) -> None:
        self.s3 = s3
        self.key = key
        self.part_bytes = part_bytes
        self.store = store  # False: verify-only (the object exists; the bytes only prove possession)
        self._buf: list[bytes] = []  # chunks as received (joined once, when they become a part or the object)
        self._buffered = 0
        self._upload_id: str | None = None
        self._parts: list[Part] = []
        self._inflight: asyncio.Task[Part] | None = None
        self._next = 1
        self._closed = False

    @property
    def multipart(self) -> bool:
        return self._upload_id is not None

    async def write(self, chunk: bytes) -> None:
        if not self.store:
            return
        self._buf.append(chunk)
        self._buffered += len(chunk)
        if self._buffered >= self.part_bytes:
            await self._flush()

    def _take(self) -> bytes:
        data = self._buf[0] if len(self._buf) == 1 else b"".join(self._buf)
        self._buf, self._buffered = [], 0
        return data

    async def _flush(self) -> None:
        data = self._take()
        if self._upload_id is None:
            self._upload_id = await self.s3.create_multipart(self.key)
        if self._inflight is not None:
            self._parts.append(await self._inflight)
            self._inflight = None
        n, self._next = self._next, self._next + 1
        self._inflight = asyncio.ensure_future(self.s3.upload_part(self.key, self._upload_id, n, data))

    async def commit(self, final_key: str) -> None:
        """Make the verified bytes the object ``final_key``."""
        if not self.store:
            raise RuntimeError("a verify-only writer has nothing to commit")
        if self._upload_id is None:
            await self.s3.put(final_key, self._take())
            self._closed = True
            return
        if self._buf:
            await self._flush()
        if self._inflight is not None:
            self._parts.append(await self._inflight)
            self._inflight = None
        await self.s3.complete_multipart(self.key, self._upload_id, self._parts)
        self._closed = True
        if self.key != final_key:
            await self.s3.copy(self.key, final_key)
            try:
                await self.s3.remove(self.key)
            except Exception as exc:  # noqa: BLE001 - a leftover staging object is collected later
                log.warning("staging-remove-failed", key=self.key, error=str(exc)[:200])

    async def discard(self) -> None:
        """Drop whatever was written (best effort: the collector aborts what is left)."""
        self._buf, self._buffered = [], 0
        if self._inflight is not None:
            self._inflight.cancel()
            await asyncio.gather(self._inflight, return_exceptions=True)
            self._inflight = None
        if self._upload_id is not None and not self._closed:
            self._closed = True
            try:
                await self.s3.abort_multipart(self.key, self._upload_id)
            except Exception as exc:  # noqa: BLE001
                log.warning("multipart-abort-failed", key=self.key, error=str(exc)[:200])
