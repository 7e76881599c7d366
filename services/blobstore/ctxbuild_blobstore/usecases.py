"""The blob store's operations: each combines the pure domain with the two stores, in the order that keeps
a crash harmless (object first, then metadata: the worst case is an unreferenced object, collected later)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import structlog
from ctxbuild_codec.trim import handle_prefix_from_uri, sha256_hex, vfs_handle, vfs_uri
from ctxbuild_platform.errors import InvalidPayload
from ctxbuild_platform.telemetry import span

from .adapters.postgres import Postgres
from .adapters.s3 import ObjectStore
from .domain.binary import decode_text
from .domain.fsread import Resolved, fs_read_error, fs_read_page, resolve_prefix
from .domain.readfile import read_file_error, read_file_page

log = structlog.get_logger("blobstore")

DEFAULT_MEDIA_TYPE = "text/plain"


class TextCache:
    """LRU of decoded blob texts by sha256. Content-addressed, so an entry can never be stale."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._bytes = 0

    def get(self, sha256: str) -> str | None:
        item = self._items.get(sha256)
        if item is None:
            return None
        self._items.move_to_end(sha256)
        return item[0]

    def put(self, sha256: str, text: str, size: int) -> None:
        if size > self.max_bytes // 4 or sha256 in self._items:
            return  # one huge blob must not flush everything else
        self._items[sha256] = (text, size)
        self._bytes += size
        while self._bytes > self.max_bytes and self._items:
            _, (_, s) = self._items.popitem(last=False)
            self._bytes -= s


def _encode(content: str) -> bytes:
    try:
        return content.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate from JSON "\ud800": no UTF-8 form, no identity
        raise InvalidPayload(f"content is not valid Unicode text: {exc.reason} at {exc.start}") from exc


@dataclass
class BlobStore:
    db: Postgres
    s3: ObjectStore
    read_cap: int = 50_000
    max_read_bytes: int = 64 * 1024 * 1024
    cache: TextCache | None = None

    async def put(self, req: dict[str, Any]) -> dict[str, Any]:
        content = req["content"]
        data = _encode(content)
        sha = sha256_hex(content)
        media_type = req.get("mediaType") or DEFAULT_MEDIA_TYPE
        with span("blob.put", sha256=sha, size=len(data), role=req["role"]):
            await self.s3.ensure_object(sha, data)
            created = await self.db.record_put(
                sha256=sha, size=len(data), chars=len(content), media_type=media_type,
                owner_kind=req["owner"]["kind"], owner_id=req["owner"]["id"], role=req["role"],
                conversation_id=req["conversationId"])
        return {"sha256": sha, "uri": vfs_uri(sha), "handle": vfs_handle(sha), "size": len(data), "created": created}

    async def attach(self, req: dict[str, Any]) -> dict[str, Any]:
        content = req["content"]
        data = _encode(content)
        sha = sha256_hex(content)
        with span("blob.attach", sha256=sha, size=len(data)):
            await self.s3.ensure_object(sha, data)
            att = await self.db.record_attachment(
                conversation_id=req["conversationId"], display_name=req["displayName"], sha256=sha,
                size=len(data), chars=len(content), media_type=req["mediaType"])
        return {"sha256": sha, "uri": vfs_uri(sha), "handle": att.handle, "displayName": att.display_name,
                "size": att.size, "mediaType": att.media_type}

    async def _text(self, sha256: str) -> str | None | bool:
        """The blob's text; None when the object is gone; False when it is not text."""
        if self.cache is not None and (hit := self.cache.get(sha256)) is not None:
            return hit
        data = await self.s3.get(sha256)
        if data is None:
            return None
        text = decode_text(data)
        if text is None:
            return False
        if self.cache is not None:
            self.cache.put(sha256, text, len(data))
        return text

    async def fs_read(self, req: dict[str, Any]) -> dict[str, Any]:
        uri = req["uri"]
        prefix = handle_prefix_from_uri(uri)
        if prefix is None:
            shown = uri if len(uri) <= 200 else uri[:200] + "…"
            return fs_read_error("parse-error", f"not a stored-output URI: {shown!r} "
                                                "(expected context://vfs/vfs_<16 hex>.txt)")
        with span("blob.fs_read", prefix=prefix, conversation=req["conversationId"], turn=req.get("turnId")):
            resolved = resolve_prefix(prefix, await self.db.candidates(prefix, req["conversationId"]))
            if not isinstance(resolved, Resolved):
                log.info("fs_read-refused", prefix=prefix, code=resolved["code"],
                         conversation=req["conversationId"])
                return resolved
            if resolved.size > self.max_read_bytes:
                return fs_read_error("too-large", f"vfs_{prefix}.txt is {resolved.size} bytes, over the "
                                                  f"{self.max_read_bytes}-byte limit for fs_read")
            text = await self._text(resolved.sha256)
            if text is None:
                return fs_read_error("not-found", f"vfs_{prefix}.txt is no longer available")
            if text is False:
                return fs_read_error("binary", f"vfs_{prefix}.txt is binary content, not text")
            return fs_read_page(text, req.get("offset", 1), req.get("limit", 2000), self.read_cap)

    async def read_file(self, req: dict[str, Any]) -> dict[str, Any]:
        conversation, name = req["conversationId"], req["filename"]
        with span("blob.read_file", conversation=conversation):
            att = await self.db.attachment(conversation, name)
            if att is None:
                known = await self.db.attachment_handles(conversation)
                hint = f"; attached files: {', '.join(known)}" if known else "; this conversation has no attachments"
                return read_file_error("not-found", f"no attached file named {name!r}{hint}")
            if att.size > self.max_read_bytes:
                return read_file_error("too-large", f"{name} is {att.size} bytes, over the "
                                                    f"{self.max_read_bytes}-byte limit for read_file")
            text = await self._text(att.sha256)
            if text is None:
                return read_file_error("not-found", f"{name} is no longer available")
            if text is False:
                return read_file_error("binary", f"{name} is binary content, not text")
            return read_file_page(text, req.get("offset", 0), req.get("limit", 8000))
