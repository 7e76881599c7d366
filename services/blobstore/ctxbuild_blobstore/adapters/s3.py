"""Object bytes in S3-compatible storage (MinIO in production, SeaweedFS locally), key ``blobs/<sha256>``.

The minio client is blocking, so every call runs in a worker thread. Timeouts are short and retries few:
a dead S3 must turn into a retryable DependencyUnavailable within seconds, not hang a turn. Calls whose
duration grows with the object (completing a multipart upload, a server-side copy of 100 MB) use a second
client with a longer read timeout.

Multipart uploads use minio's low-level calls (``_create_multipart_upload``, ``_upload_part``,
``_complete_multipart_upload``, ``_abort_multipart_upload``, ``_list_multipart_uploads``): the high-level
``put_object`` cannot verify a content hash before completing, and a multipart upload only becomes a visible
object when it is completed. They are used here only, and pinned by ``tests/unit/test_blobstore_adapters.py``.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import io
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime
from itertools import islice
from typing import Any, TypeVar
from urllib.parse import urlsplit

import certifi
import urllib3
from ctxbuild_platform.errors import DependencyUnavailable
from ctxbuild_platform.telemetry import span
from minio import Minio
from minio.commonconfig import CopySource
from minio.datatypes import Part
from minio.error import InvalidResponseError, S3Error, ServerError
from minio.helpers import MIN_PART_SIZE

from ..domain.gcpolicy import StoredObject
from ..domain.keys import object_key

T = TypeVar("T")
_MISSING = {"NoSuchKey", "NotFound", "ResourceNotFound", "NoSuchUpload"}
CONTENT_TYPE = "text/plain; charset=utf-8"


@dataclass(frozen=True, slots=True)
class PendingUpload:
    key: str
    upload_id: str
    initiated: datetime | None


def _http(timeout: float, read_timeout: float, secure: bool) -> urllib3.PoolManager:
    return urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=timeout, read=read_timeout),
        maxsize=32,
        retries=urllib3.Retry(total=1, backoff_factor=0.1, status_forcelist=[500, 502, 503, 504]),
        **({"cert_reqs": "CERT_REQUIRED", "ca_certs": certifi.where()} if secure else {}),
    )


class ObjectStore:
    def __init__(self, endpoint: str, access_key: str, secret_key: str, bucket: str, *,
                 region: str = "us-east-1", timeout: float = 3.0, slow_timeout: float = 120.0) -> None:
        parts = urlsplit(endpoint)
        secure = parts.scheme == "https"

        def client(read_timeout: float) -> Minio:
            return Minio(parts.netloc, access_key=access_key, secret_key=secret_key, secure=secure,
                         region=region, http_client=_http(timeout, read_timeout, secure))

        self.client = client(timeout)
        self.slow = client(slow_timeout)
        self.bucket = bucket
        # an overall bound under callers' usual 10 s request timeout; a stuck thread may linger, the caller not
        self.deadline = 2 * timeout + 1.0
        self.slow_deadline = slow_timeout + timeout + 1.0

    @staticmethod
    def _submit(fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        """Hand the blocking call to a worker thread now (``asyncio.to_thread`` would wait for its coroutine to
        be scheduled first); the context goes along, as with to_thread."""
        ctx = contextvars.copy_context()
        return asyncio.get_running_loop().run_in_executor(None, functools.partial(ctx.run, fn, *args, **kwargs))

    async def _call(self, what: str, fn: Callable[..., T], *args: Any, slow: bool = False, **kwargs: Any) -> T:
        return await self._settle(what, self._submit(fn, *args, **kwargs), slow=slow)

    async def _settle(self, what: str, call: asyncio.Future[T], *, slow: bool = False) -> T:
        try:
            return await asyncio.wait_for(call, timeout=self.slow_deadline if slow else self.deadline)
        except S3Error:
            raise  # callers decide what a missing key means
        except TimeoutError as exc:
            raise DependencyUnavailable(f"s3: {what} timed out") from exc
        except (urllib3.exceptions.HTTPError, OSError, ServerError, InvalidResponseError, ValueError) as exc:
            raise DependencyUnavailable(f"s3: {what} failed: {type(exc).__name__}: {str(exc)[:200]}") from exc

    async def _s3(self, what: str, fn: Callable[..., T], *args: Any, missing_ok: bool = False, slow: bool = False,
                  **kwargs: Any) -> T | None:
        try:
            return await self._call(what, fn, *args, slow=slow, **kwargs)
        except S3Error as exc:
            if missing_ok and exc.code in _MISSING:
                return None
            raise DependencyUnavailable(f"s3: {what} failed: {exc.code}: {exc.message}") from exc

    # ---------- bucket ----------
    async def ensure_bucket(self) -> None:
        if not await self._s3("bucket_exists", self.client.bucket_exists, self.bucket):
            try:
                await self._call("make_bucket", self.client.make_bucket, self.bucket)
            except S3Error as exc:
                if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):  # a replica won the race
                    raise DependencyUnavailable(f"s3: make_bucket failed: {exc.code}: {exc.message}") from exc

    async def ping(self) -> bool:
        return bool(await self._s3("bucket_exists", self.client.bucket_exists, self.bucket))

    # ---------- whole objects ----------
    async def put(self, key: str, data: bytes, content_type: str = CONTENT_TYPE) -> None:
        """One PUT of ``data`` (never a multipart upload, whatever its size)."""
        with span("s3.put", key=key, size=len(data)):
            await self._s3("put_object", self._put, key, data, content_type, slow=len(data) > (4 << 20))

    def _put(self, key: str, data: bytes, content_type: str) -> None:
        client = self.slow if len(data) > (4 << 20) else self.client
        client.put_object(self.bucket, key, io.BytesIO(data), len(data), content_type=content_type,
                          part_size=max(len(data), MIN_PART_SIZE))

    async def ensure_object(self, sha256: str, data: bytes, content_type: str = CONTENT_TYPE) -> bool:
        """Write ``blobs/<sha256>`` unless an object of that size is there; True when written."""
        key = object_key(sha256)
        stat = await self.stat(key)
        if stat is not None and stat == len(data):
            return False
        await self.put(key, data, content_type)
        return True

    async def stat(self, key: str) -> int | None:
        """The object's size, or None when it does not exist."""
        st = await self._s3("stat_object", self.client.stat_object, self.bucket, key, missing_ok=True)
        return None if st is None else int(st.size)

    async def get(self, sha256: str) -> bytes | None:
        """The whole object ``blobs/<sha256>``, or None when it is gone."""
        return await self.read(object_key(sha256))

    async def read(self, key: str, start: int = 0, length: int | None = None) -> bytes | None:
        """Bytes ``[start, start+length)`` (to the end when length is None), or None when the object is gone."""
        with span("s3.get", key=key, start=start, length=length or 0):
            return await self._s3("get_object", self._read, key, start, length, missing_ok=True,
                                  slow=length is None or length > (4 << 20))

    def _read(self, key: str, start: int, length: int | None) -> bytes:
        client = self.slow if length is None or length > (4 << 20) else self.client
        resp = client.get_object(self.bucket, key, offset=start, length=length or 0)
        try:
            data = resp.read()
        except BaseException:
            resp.close()
            raise
        finally:
            resp.release_conn()  # fully read: the connection goes back to the pool (close() would drop it)
        return data

    async def open(self, key: str, start: int = 0, length: int | None = None,
                   prefetch: int = 0) -> ObjectReader | None:
        """A reader over bytes ``[start, start+length)`` (to the end when length is None); None when the object
        is missing. The request is sent now; the body is read piece by piece with :meth:`ObjectReader.read`.
        ``prefetch``: read up to that many bytes of the body in the same worker-thread call (one thread hop
        instead of two for the first piece)."""
        return await self.open_soon(key, start, length, prefetch)

    def open_soon(self, key: str, start: int = 0, length: int | None = None,
                  prefetch: int = 0) -> asyncio.Task[ObjectReader | None]:
        """:meth:`open`, with the request handed to a worker thread before this returns (a read that races
        another lookup starts at once)."""
        call = self._submit(self._open, key, start, length, prefetch)

        async def opened() -> ObjectReader | None:
            try:
                resp, head = await self._settle("get_object", call)
            except S3Error as exc:
                if exc.code in _MISSING:
                    return None
                raise DependencyUnavailable(f"s3: get_object failed: {exc.code}: {exc.message}") from exc
            return ObjectReader(self, resp, key, head)

        return asyncio.ensure_future(opened())

    def _open(self, key: str, start: int, length: int | None, prefetch: int) -> tuple[Any, bytes]:
        resp = self.client.get_object(self.bucket, key, offset=start, length=length or 0)
        if prefetch <= 0:
            return resp, b""
        try:
            return resp, resp.read(prefetch)
        except BaseException:
            resp.close()
            resp.release_conn()
            raise

    async def stream(self, key: str, start: int, length: int, piece: int) -> AsyncIterator[bytes]:
        """Bytes ``[start, start+length)`` in pieces of ``piece`` bytes (the last may be shorter), reading one
        piece at a time: memory stays at one piece whatever the object's size. :class:`ObjectGone` when the
        object is missing."""
        if length <= 0:
            return
        if length <= piece:
            data = await self.read(key, start, length)
            if data is None:
                raise ObjectGone(key)
            yield data
            return
        reader = await self.open(key, start, length)
        if reader is None:
            raise ObjectGone(key)
        try:
            async for data in reader.pieces(length, piece):
                yield data
        finally:
            reader.close()

    async def remove(self, key: str) -> None:
        with span("s3.remove", key=key):
            await self._s3("remove_object", self.client.remove_object, self.bucket, key)

    async def copy(self, src: str, dst: str) -> None:
        """Server-side copy (single CopyObject: objects up to 5 GiB)."""
        with span("s3.copy", src=src, dst=dst):
            await self._s3("copy_object", self.slow.copy_object, self.bucket, dst, CopySource(self.bucket, src),
                           slow=True)

    # ---------- multipart ----------
    async def create_multipart(self, key: str, content_type: str = CONTENT_TYPE) -> str:
        return await self._s3("create_multipart_upload", self.client._create_multipart_upload, self.bucket, key,
                              {"Content-Type": content_type})

    async def upload_part(self, key: str, upload_id: str, number: int, data: bytes) -> Part:
        with span("s3.upload_part", key=key, part=number, size=len(data)):
            etag = await self._s3("upload_part", self.slow._upload_part, self.bucket, key, data, None, upload_id,
                                  number, slow=True)
        return Part(number, etag)

    async def complete_multipart(self, key: str, upload_id: str, parts: list[Part]) -> None:
        with span("s3.complete_multipart", key=key, parts=len(parts)):
            await self._s3("complete_multipart_upload", self.slow._complete_multipart_upload, self.bucket, key,
                           upload_id, parts, slow=True)

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        await self._s3("abort_multipart_upload", self.client._abort_multipart_upload, self.bucket, key, upload_id,
                       missing_ok=True)

    async def pending_uploads(self, prefix: str) -> list[PendingUpload]:
        out: list[PendingUpload] = []
        key_marker = upload_marker = None
        while True:
            res = await self._s3("list_multipart_uploads", self.client._list_multipart_uploads, self.bucket,
                                 prefix=prefix, key_marker=key_marker, upload_id_marker=upload_marker,
                                 max_uploads=1000)
            for u in res.uploads:
                out.append(PendingUpload(u.object_name, u.upload_id, u.initiated_time))
            # minio 7.2 stores NextUploadIdMarker under a mangled name; the key marker alone still advances
            nxt = (res.next_key_marker, getattr(res, "self._next_upload_id_marker", None))
            if not res.is_truncated or not res.uploads or nxt == (key_marker, upload_marker) or nxt[0] is None:
                return out
            key_marker, upload_marker = nxt

    # ---------- listing ----------
    async def list_objects(self, prefix: str, batch: int = 1000) -> AsyncIterator[list[StoredObject]]:
        """Every object under ``prefix``, in batches (the listing is paged by S3 as it goes)."""
        it = self.client.list_objects(self.bucket, prefix=prefix, recursive=True)

        def take() -> tuple[int, list[StoredObject]]:
            raw = list(islice(it, batch))
            return len(raw), [StoredObject(o.object_name, o.last_modified) for o in raw
                              if o.object_name is not None and o.last_modified is not None]

        while True:
            n, got = await self._s3("list_objects", take)
            if got:
                yield got
            if n < batch:
                return


class ObjectReader:
    """An open GET response, read in pieces off the event loop."""

    def __init__(self, store: ObjectStore, resp: Any, key: str, head: bytes = b"") -> None:
        self.store = store
        self.resp = resp
        self.key = key
        self._head = head  # body bytes already read by ObjectStore.open(prefetch=…)
        self._complete = False

    async def read(self, n: int) -> bytes:
        if self._head:
            data, self._head = self._head[:n], self._head[n:]
            return data
        return await self.store._call("get_object.read", self.resp.read, n)

    async def pieces(self, length: int, piece: int) -> AsyncIterator[bytes]:
        left = length
        while left > 0:
            data = await self.read(min(piece, left))
            if not data:
                raise DependencyUnavailable(f"s3: {self.key} ended {left} bytes early")
            left -= len(data)
            yield data
        self._complete = True

    def close(self) -> None:
        if not self._complete:
            self.resp.close()  # unread body: the connection cannot be reused
        self.resp.release_conn()


class ObjectGone(Exception):
    """The metadata names an object S3 no longer has (deleted out of band)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key
