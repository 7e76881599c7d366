"""Object bytes in S3-compatible storage (MinIO in production, SeaweedFS locally), key ``blobs/<sha256>``.

The minio client is blocking, so every call runs in a worker thread. Timeouts are short and retries few:
a dead S3 must turn into a retryable DependencyUnavailable within seconds, not hang a turn.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import certifi
import urllib3
from ctxbuild_platform.errors import DependencyUnavailable
from ctxbuild_platform.telemetry import span
from minio import Minio
from minio.error import InvalidResponseError, S3Error, ServerError

T = TypeVar("T")
_MISSING = {"NoSuchKey", "NotFound", "ResourceNotFound"}


def object_key(sha256: str) -> str:
    return f"blobs/{sha256}"


class ObjectStore:
    def __init__(self, endpoint: str, access_key: str, secret_key: str, bucket: str, *,
                 region: str = "us-east-1", timeout: float = 3.0) -> None:
        parts = urlsplit(endpoint)
        secure = parts.scheme == "https"
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=timeout, read=timeout),
            maxsize=32,
            retries=urllib3.Retry(total=1, backoff_factor=0.1, status_forcelist=[500, 502, 503, 504]),
            **({"cert_reqs": "CERT_REQUIRED", "ca_certs": certifi.where()} if secure else {}),
        )
        self.client = Minio(parts.netloc, access_key=access_key, secret_key=secret_key, secure=secure,
                            region=region, http_client=http)
        self.bucket = bucket
        # an overall bound under callers' usual 10 s request timeout; a stuck thread may linger, the caller not
        self.deadline = 2 * timeout + 1.0

    async def _call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn, *args, **kwargs), timeout=self.deadline)
        except S3Error:
            raise  # callers decide what a missing key means
        except TimeoutError as exc:
            raise DependencyUnavailable(f"s3: {what} timed out") from exc
        except (urllib3.exceptions.HTTPError, OSError, ServerError, InvalidResponseError) as exc:
            raise DependencyUnavailable(f"s3: {what} failed: {type(exc).__name__}: {str(exc)[:200]}") from exc

    async def _s3(self, what: str, fn: Callable[..., T], *args: Any, missing_ok: bool = False,
                  **kwargs: Any) -> T | None:
        try:
            return await self._call(what, fn, *args, **kwargs)
        except S3Error as exc:
            if missing_ok and exc.code in _MISSING:
                return None
            raise DependencyUnavailable(f"s3: {what} failed: {exc.code}: {exc.message}") from exc

    async def ensure_bucket(self) -> None:
        if not await self._s3("bucket_exists", self.client.bucket_exists, self.bucket):
            try:
                await self._call("make_bucket", self.client.make_bucket, self.bucket)
            except S3Error as exc:
                if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):  # a replica won the race
                    raise DependencyUnavailable(f"s3: make_bucket failed: {exc.code}: {exc.message}") from exc

    async def ping(self) -> bool:
        return bool(await self._s3("bucket_exists", self.client.bucket_exists, self.bucket))

    async def ensure_object(self, sha256: str, data: bytes, content_type: str = "text/plain; charset=utf-8") -> bool:
        """Write the object unless an identical one (same key, same size) is there; True when written."""
        key = object_key(sha256)
        with span("s3.put", key=key, size=len(data)):
            stat = await self._s3("stat_object", self.client.stat_object, self.bucket, key, missing_ok=True)
            if stat is not None and stat.size == len(data):
                return False
            await self._s3("put_object", self.client.put_object, self.bucket, key, io.BytesIO(data), len(data),
                           content_type=content_type)
            return True

    async def get(self, sha256: str) -> bytes | None:
        """The object's bytes, or None when it is gone."""
        key = object_key(sha256)
        with span("s3.get", key=key):
            return await self._s3("get_object", self._read, key, missing_ok=True)

    def _read(self, key: str) -> bytes:
        resp = self.client.get_object(self.bucket, key)
        try:
            return resp.read()
        finally:
            resp.close()
            resp.release_conn()
