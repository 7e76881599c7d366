"""The blob store's operations: each combines the pure domain with the stores, in the order that keeps a crash
harmless (object first, then the metadata commit: the worst case is an unreferenced object, collected later).

Every write runs in a transaction holding the blob's shared advisory lock (``Postgres.blob_lock``) from its
existence check to its metadata commit, so the collector can never delete what a concurrent put is re-referencing.
Reads stream: a page of a 100 MB blob is a ranged S3 read located by the blob's seek index, never the whole object
in memory.
"""

from __future__ import annotations

import asyncio
import codecs
import hashlib
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any, Protocol

import structlog
from ctxbuild_codec.contract_models import dump
from ctxbuild_codec.models.model.offload import Offload
from ctxbuild_codec.models.subjects.ctx_blob_attach_reply import CtxBlobAttachReply
from ctxbuild_codec.models.subjects.ctx_blob_attach_request import CtxBlobAttachRequest
from ctxbuild_codec.models.subjects.ctx_blob_fs_read_reply import CtxBlobFsReadReply
from ctxbuild_codec.models.subjects.ctx_blob_fs_read_request import CtxBlobFsReadRequest
from ctxbuild_codec.models.subjects.ctx_blob_get_reply import CtxBlobGetReply
from ctxbuild_codec.models.subjects.ctx_blob_get_request import (
    CtxBlobGetRequest,
    CtxBlobGetRequest1,
    CtxBlobGetRequest2,
)
from ctxbuild_codec.models.subjects.ctx_blob_get_result_reply import CtxBlobGetResultReply, Output
from ctxbuild_codec.models.subjects.ctx_blob_get_result_request import CtxBlobGetResultRequest
from ctxbuild_codec.models.subjects.ctx_blob_put_reply import CtxBlobPutReply
from ctxbuild_codec.models.subjects.ctx_blob_put_request import CtxBlobPutRequest
from ctxbuild_codec.models.subjects.ctx_blob_read_file_reply import CtxBlobReadFileReply
from ctxbuild_codec.models.subjects.ctx_blob_read_file_request import CtxBlobReadFileRequest
from ctxbuild_codec.models.subjects.ctx_blob_ref_reply import CtxBlobRefReply
from ctxbuild_codec.models.subjects.ctx_blob_ref_request import CtxBlobRefRequest
from ctxbuild_codec.models.subjects.ctx_blob_release_reply import CtxBlobReleaseReply
from ctxbuild_codec.models.subjects.ctx_blob_release_request import CtxBlobReleaseRequest
from ctxbuild_codec.models.subjects.ctx_blob_upload_reply import Attachment as UploadedAttachment
from ctxbuild_codec.models.subjects.ctx_blob_upload_reply import CtxBlobUploadReply
from ctxbuild_codec.models.subjects.ctx_blob_upload_request import CtxBlobUploadRequest
from ctxbuild_codec.trim import handle_prefix_from_uri, vfs_handle, vfs_uri
from ctxbuild_platform.errors import DependencyUnavailable, InvalidPayload, NotFound, ServiceError
from ctxbuild_platform.telemetry import span
from pydantic import BaseModel

from ..adapters.postgres import Attachment, BlobInfo, LockedBlob, NewBlob, Postgres, RefSpec
from ..adapters.s3 import ObjectGone, ObjectReader, ObjectStore
from ..adapters.transfer import Transfer
from ..adapters.writer import ObjectWriter
from ..domain.access import ReadScope
from ..domain.cache import ByteCache
from ..domain.fsread import (
    Candidate,
    LinePager,
    LineSearch,
    Resolved,
    compile_pattern,
    fs_read_error,
    resolve_prefix,
)
from ..domain.keys import INBOX, object_key, temp_key
from ..domain.readfile import CharPager, read_file_error, read_file_not_found, read_file_range_error
from ..domain.textindex import DEFAULT_STRIDE, Indexer, Marks, TextIndex, index_bytes, origin_marks

log = structlog.get_logger("blobstore")

DEFAULT_MEDIA_TYPE = "text/plain"
READ_PIECE = 256 * 1024  # bytes per S3 read while paging


# error codes of the blob store's own (platform ServiceError / InvalidPayload carry them)
ACCESS_DENIED = "access-denied"
AMBIGUOUS_HANDLE = "ambiguous-handle"
TOO_LARGE = "too-large"
# the uploaded bytes are not the content the caller declared (sha256/size): a malformed request, with its own code
# since the bytes were streamed before the mismatch could be seen
DIGEST_MISMATCH = "digest-mismatch"


@dataclass(frozen=True)
class Config:
    read_cap: int = 50_000
    max_read_bytes: int = 4 << 30
    chunk_bytes: int = 512 * 1024
    part_bytes: int = 8 << 20
    upload_max_bytes: int = 2 << 30
    max_uploads: int = 4
    index_stride: int = DEFAULT_STRIDE
    cache_object_max: int = 1 << 20
    fault_exit_after_object_write: bool = False
    result_max_bytes: int = 640 * 1024  # get_result replies inline: stay well under NATS max_payload
    pattern_timeout_s: float = 2.0  # fs_read with a pattern: one deadline for the whole search


def _encode(content: str) -> bytes:
    try:
        return content.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate from JSON "\ud800": no UTF-8 form, no identity
        raise InvalidPayload(f"content is not valid Unicode text: {exc.reason} at {exc.start}") from exc


def _texts_ok(*values: BaseModel | str | None) -> None:
    """Postgres text cannot hold NUL: an id or name with one is a malformed request (never a storage error).
    A model is checked field by field, its ``content`` (stored as bytes) aside."""
    stack: list[Any] = [v.model_dump(exclude={"content"}) if isinstance(v, BaseModel) else v for v in values]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, str) and "\x00" in v:
            raise InvalidPayload("identifiers and names must not contain NUL characters")


class _Referencing(Protocol):
    """A request that names one reference (blob, owner, role) for a conversation."""

    conversationId: str
    role: Any

    @property
    def owner(self) -> Any: ...


class _LinePaging(Protocol):
    """What :class:`LinePager` and :class:`LineSearch` share: fed text, they answer a page of lines."""

    done: bool
    last: int

    def feed(self, piece: str) -> bool: ...

    def result(self, at_end: bool = True) -> dict[str, Any]: ...


def _ref(req: _Referencing) -> RefSpec:
    return RefSpec(req.owner.kind, req.owner.id, req.role, req.conversationId, _members(req))


def _members(req: Any) -> tuple[str, ...]:
    """A put's declared transcript members as handles (the schema's pattern makes every URI parse)."""
    uris = getattr(req, "members", None) or ()
    return tuple(dict.fromkeys(p for u in uris if (p := handle_prefix_from_uri(getattr(u, "root", u))) is not None))


def _identity(sha: str, size: int, created: bool) -> dict[str, Any]:
    return {"sha256": sha, "uri": vfs_uri(sha), "handle": vfs_handle(sha), "size": size, "created": created}


class BlobStore:
    def __init__(self, db: Postgres, s3: ObjectStore, transfer: Transfer | None = None, *,
                 config: Config | None = None, cache: ByteCache | None = None) -> None:
        self.db = db
        self.s3 = s3
        self.transfer = transfer
        self.cfg = config or Config()
        self.cache = cache
        self._marks: OrderedDict[str, tuple[Marks, Marks]] = OrderedDict()
        self._upload_slots = asyncio.Semaphore(self.cfg.max_uploads)

    # ======================================================================== writes
    def _crash_point(self) -> None:
        if self.cfg.fault_exit_after_object_write:
            log.warning("fault-injection-exit", where="after-object-write")
            os._exit(70)

    async def _store_small(self, sha: str, data: bytes, media_type: str, ref: RefSpec,
                           attachment: tuple[str, str] | None) -> tuple[bool, Attachment | None]:
        # the text index is computed while Postgres takes the lock (unused when the blob already exists)
        async with self.db.blob_lock(sha, meanwhile=lambda: index_bytes(data, self.cfg.index_stride)) as blob:
            if await blob.exists():
                return await blob.record(None, ref, attachment)
            return await self._object_then_metadata(blob, self.s3.put(object_key(sha), data),
                                                    NewBlob(len(data), media_type, blob.prepared), ref, attachment)

    async def _object_then_metadata(self, blob: LockedBlob, write: Coroutine[Any, Any, None], new: NewBlob,
                                    ref: RefSpec, attachment: tuple[str, str] | None
                                    ) -> tuple[bool, Attachment | None]:
        """Write the object, record its metadata + reference. The INSERT runs while the object is being written:
        it belongs to the blob lock's transaction, which commits only after this returns — after the object
        exists — so no reader ever sees metadata without its object, and a failed write rolls the row back. An
        attachment's statements wait for the write instead (allocating its handle locks the conversation's
        handles, which should not be held across S3 I/O)."""
        if attachment is not None:
            await write
            self._crash_point()
            return await blob.record(new, ref, attachment)
        # the INSERT goes out first, then the write is handed to its worker thread: the thread then starts while
        # the loop only waits (handing over the write first, the thread would wait for the loop to finish
        # building the INSERT)
        recording = asyncio.ensure_future(blob.record(new, ref, None))
        writing: asyncio.Future | None = None
        try:
            await asyncio.sleep(0)
            writing = asyncio.ensure_future(write)
            recorded = await recording
            await writing
        except BaseException:
            if writing is None:
                write.close()  # never started
            else:
                writing.cancel()  # (a worker thread's S3 call runs to its end regardless; its result is dropped)
            # the connection must be idle before the lock's ROLLBACK
            await asyncio.gather(recording, *([writing] if writing else []), return_exceptions=True)
            raise
        self._crash_point()
        return recorded

    async def put(self, req: CtxBlobPutRequest) -> CtxBlobPutReply:
        """Content-addressed put plus one reference (blob, owner, role) for a conversation (content inline:
        up to ~700 KB; larger content goes through ctx.blob.upload)."""
        _texts_ok(req)
        data = _encode(req.content)
        sha = hashlib.sha256(data).hexdigest()
        declared = req.sha256
        if declared is not None and declared != sha:
            # the caller's digest does not describe this content: storing it would bind the wrong identity
            raise InvalidPayload(f"declared sha256 {declared} does not match the content's sha256 {sha}",
                                 details={"declared": declared, "actual": sha})
        with span("blob.put", sha256=sha, size=len(data), role=req.role):
            created, _ = await self._store_small(sha, data, req.mediaType or DEFAULT_MEDIA_TYPE, _ref(req), None)
        return CtxBlobPutReply(**_identity(sha, len(data), created))

    async def attach(self, req: CtxBlobAttachRequest) -> CtxBlobAttachReply:
        """Attachment upload: the display name becomes a handle unique in the conversation."""
        _texts_ok(req)
        data = _encode(req.content)
        sha = hashlib.sha256(data).hexdigest()
        conv = req.conversationId
        with span("blob.attach", sha256=sha, size=len(data)):
            _, att = await self._store_small(sha, data, req.mediaType,
                                             RefSpec("conversation", conv, "attachment", conv),
                                             (req.displayName, req.mediaType))
        assert att is not None
        return CtxBlobAttachReply(sha256=sha, uri=vfs_uri(sha), handle=att.handle, displayName=att.display_name,
                                  size=att.size, mediaType=att.media_type)

    async def ref(self, req: CtxBlobRefRequest) -> CtxBlobRefReply:
        """One more reference to a blob the same conversation already references (no bytes travel)."""
        _texts_ok(req)
        sha, conv = req.sha256, req.conversationId
        async with self.db.blob_lock(sha) as blob:
            if not await blob.exists():
                raise NotFound(f"no blob {sha}")
            if not await blob.referenced_by(conv):
                raise ServiceError(f"blob {sha} is not referenced by conversation {conv!r}", code=ACCESS_DENIED)
            await blob.record(None, _ref(req), None)
        found = await self.db.blob(sha, conv)
        return CtxBlobRefReply(**_identity(sha, found[0].size if found else 0, False))

    async def release(self, req: CtxBlobReleaseRequest) -> CtxBlobReleaseReply:
        """Drop an owner's references; a blob left with none is collected after the grace period."""
        _texts_ok(req)
        released = await self.db.release(req.owner.kind, req.owner.id, req.role, req.sha256)
        return CtxBlobReleaseReply(released=len(released))

    async def upload(self, request: CtxBlobUploadRequest) -> CtxBlobUploadReply:
        """Chunked put (claim check): the instance pulls the bytes from the caller's `source` inbox in chunks
        ≤ 512 KiB, hashes and indexes them as they stream into S3, then records metadata + the reference."""
        if self.transfer is None:
            raise DependencyUnavailable("no data channel configured")
        req = request.root
        _texts_ok(req)
        conv = req.conversationId
        if req.attachment is not None:
            media_type = req.attachment.mediaType or req.mediaType or DEFAULT_MEDIA_TYPE
            ref = RefSpec("conversation", conv, "attachment", conv)
            attachment: tuple[str, str] | None = (req.attachment.displayName, media_type)
        else:
            media_type = req.mediaType or DEFAULT_MEDIA_TYPE
            ref, attachment = _ref(req), None  # no attachment: the request names owner and role
        declared_sha, declared_size = req.sha256, req.size
        if declared_size is not None and declared_size > self.cfg.upload_max_bytes:
            raise ServiceError(f"{declared_size} bytes is over the {self.cfg.upload_max_bytes}-byte blob limit",
                               code=TOO_LARGE)

        if not INBOX.fullmatch(req.source):
            raise InvalidPayload("source must be a NATS inbox of the caller (_INBOX.…)")
        with span("blob.upload", conversation=conv, declared_sha256=declared_sha or "", role=ref.role):
            if declared_sha is not None:
                # the conversation already holds this content: only the reference is new, no byte travels
                async with self.db.blob_lock(declared_sha) as blob:
                    if await blob.referenced_by(conv):
                        _, att = await blob.record(None, ref, attachment)
                        found = await self.db.blob(declared_sha, conv)
                        size = found[0].size if found else 0
                        if declared_size is not None and declared_size != size:
                            raise InvalidPayload(f"declared size {declared_size} != stored size {size}",
                                                 code=DIGEST_MISMATCH)
                        return self._upload_reply(declared_sha, size, False, att, transferred=0)
            if self._upload_slots.locked():  # (a free slot is taken at once, without wait_for's extra task)
                try:
                    await asyncio.wait_for(self._upload_slots.acquire(), timeout=5.0)
                except TimeoutError as exc:
                    raise DependencyUnavailable("too many uploads in progress on this instance") from exc
            else:
                await self._upload_slots.acquire()
            try:
                return await self._upload(req.source, conv, declared_sha, declared_size, media_type, ref,
                                          attachment)
            finally:
                self._upload_slots.release()

    async def _upload(self, source: str, conv: str, declared_sha: str | None, declared_size: int | None,
                      media_type: str, ref: RefSpec, attachment: tuple[str, str] | None) -> CtxBlobUploadReply:
        assert self.transfer is not None
        # content someone else already stored: the bytes still travel (they prove possession) but are not stored
        verify_only = declared_sha is not None and bool(await self.db.known([declared_sha]))
        key = object_key(declared_sha) if declared_sha else temp_key(uuid.uuid4().hex)
        writer = ObjectWriter(self.s3, key, self.cfg.part_bytes, store=not verify_only)
        hasher, indexer, size = hashlib.sha256(), Indexer(self.cfg.index_stride), 0
        # chunks not indexed yet: while the upload fits one PUT they wait, to be indexed during the lock's round
        # trip to Postgres (the hash is needed before that, the index only after it)
        unindexed: list[bytes] = []
        t0 = time.perf_counter()
        try:
            async for chunk in self.transfer.pull(source):
                size += len(chunk)
                if size > self.cfg.upload_max_bytes:
                    raise ServiceError(f"upload is over the {self.cfg.upload_max_bytes}-byte blob limit",
                                       code=TOO_LARGE)
                hasher.update(chunk)
                if size <= self.cfg.part_bytes:
                    unindexed.append(chunk)
                else:
                    _feed(indexer, unindexed)
                    indexer.feed(chunk)
                await writer.write(chunk)
            sha = hasher.hexdigest()
            if (declared_sha is not None and sha != declared_sha) or (declared_size is not None
                                                                      and size != declared_size):
                raise InvalidPayload(f"received {size} bytes with sha256 {sha}; declared "
                                     f"{declared_size if declared_size is not None else '?'} bytes, sha256 "
                                     f"{declared_sha or '?'}", code=DIGEST_MISMATCH)
            t1 = time.perf_counter()

            def finish_index() -> TextIndex:
                _feed(indexer, unindexed)
                return indexer.finish()

            # the chunks still unindexed are indexed while Postgres takes the lock
            async with self.db.blob_lock(sha, meanwhile=finish_index) as blob:
                t2 = time.perf_counter()
                index = blob.prepared
                if await blob.exists():
                    await writer.discard()
                    created, att = await blob.record(None, ref, attachment)
                else:
                    if verify_only:
                        raise ServiceError("the blob was collected during the upload; upload again",
                                           code="conflict", retryable=True)
                    created, att = await self._object_then_metadata(
                        blob, writer.commit(object_key(sha)), NewBlob(size, media_type, index), ref, attachment)
                t3 = time.perf_counter()
            log.debug("upload-timing", size=size, pull_ms=round((t1 - t0) * 1e3, 2),
                      lock_ms=round((t2 - t1) * 1e3, 2), store_and_record_ms=round((t3 - t2) * 1e3, 2),
                      commit_ms=round((time.perf_counter() - t3) * 1e3, 2))
            return self._upload_reply(sha, size, created, att, transferred=size, index=index)
        except BaseException:
            await writer.discard()
            raise

    @staticmethod
    def _upload_reply(sha: str, size: int, created: bool, att: Attachment | None, *, transferred: int,
                      index: TextIndex | None = None) -> CtxBlobUploadReply:
        out = CtxBlobUploadReply(**_identity(sha, size, created), transferred=transferred)
        if index is not None:
            out.isText = index.is_text
            if index.is_text:
                out.chars, out.lines = index.chars, index.lines
        if att is not None:
            out.attachment = UploadedAttachment(handle=att.handle, displayName=att.display_name,
                                                mediaType=att.media_type)
        return out

    # ======================================================================== reads
    async def _whole(self, sha: str) -> bytes | None:
        if self.cache is not None and (hit := self.cache.get(sha)) is not None:
            return hit
        data = await self.s3.get(sha)
        if data is not None and self.cache is not None:
            self.cache.put(sha, data)
        return data

    async def _bytes(self, info: BlobInfo, start: int, length: int, piece: int,
                     stream: bool = False) -> AsyncIterator[bytes]:
        """The blob's bytes ``[start, start+length)``; ObjectGone when the object is missing. Small objects are
        read whole (and cached) unless ``stream`` asks to start yielding before the object is fully read."""
        if length <= 0:
            return
        cached = self.cache.get(info.sha256) if self.cache is not None else None
        if cached is not None or (info.size <= self.cfg.cache_object_max and not stream):
            data = cached if cached is not None else await self._whole(info.sha256)
            if data is None:
                raise ObjectGone(object_key(info.sha256))
            for i in range(start, start + length, piece):
                yield data[i:min(i + piece, start + length)]
            return
        async for data in self.s3.stream(object_key(info.sha256), start, length, piece):
            yield data

    async def _text(self, info: BlobInfo, start: int, length: int) -> AsyncIterator[str]:
        """Decoded text from byte ``start`` (a character boundary)."""
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        async for data in self._bytes(info, start, length, READ_PIECE):
            text = dec.decode(data)
            if text:
                yield text
        tail = dec.decode(b"", final=True)
        if tail:
            yield tail

    async def _indexed(self, info: BlobInfo) -> BlobInfo | None:
        """The blob with its text facts; rows from before the index are indexed now (one streamed pass).
        None when the object is gone."""
        if info.is_text is not None:
            return info
        indexer = Indexer(self.cfg.index_stride)
        try:
            async for data in self._bytes(info, 0, info.size, self.cfg.chunk_bytes):
                indexer.feed(data)
        except ObjectGone:
            return None
        ix = indexer.finish()
        await self.db.store_index(info.sha256, ix)
        self._marks.pop(info.sha256, None)
        return replace(info, chars=ix.chars, lines=ix.lines, is_text=ix.is_text)

    async def _as_text(self, info: BlobInfo, name: str, reader: str,
                       error: Callable[[str, str], dict[str, Any]]) -> BlobInfo | dict[str, Any]:
        """The blob with its text facts, if ``reader`` (fs_read, read_file) may page it; else that reader's
        model-facing error (built by ``error``): too large, gone, or binary."""
        if info.size > self.cfg.max_read_bytes:
            return error("too-large", f"{name} is {info.size} bytes, over the {self.cfg.max_read_bytes}-byte limit "
                                      f"for {reader}")
        indexed = await self._indexed(info)
        if indexed is None:
            return error("not-found", f"{name} is no longer available")
        if not indexed.is_text:
            return error("binary", f"{name} is binary content, not text")
        return indexed

    async def _seek_marks(self, info: BlobInfo) -> tuple[Marks, Marks]:
        if info.size <= self.cfg.index_stride:
            return origin_marks(1), origin_marks(0)
        hit = self._marks.get(info.sha256)
        if hit is not None:
            self._marks.move_to_end(info.sha256)
            return hit
        marks = await self.db.marks(info.sha256)
        self._marks[info.sha256] = marks
        while len(self._marks) > 64:
            self._marks.popitem(last=False)
        return marks

    async def fs_read(self, req: CtxBlobFsReadRequest) -> CtxBlobFsReadReply:
        """A numbered page of an offloaded output by URI (allow-list enforced here)."""
        return CtxBlobFsReadReply.model_validate(await self._fs_read(req))

    async def _fs_read(self, req: CtxBlobFsReadRequest) -> dict[str, Any]:
        uri, conversation, turn = req.uri, req.conversationId, req.turnId
        prefix = handle_prefix_from_uri(uri)
        if prefix is None:
            shown = uri if len(uri) <= 200 else uri[:200] + "…"
            return fs_read_error("parse-error", f"not a stored-output URI: {shown!r} "
                                                "(expected context://vfs/vfs_<16 hex>.txt)")
        _texts_ok(conversation, turn)
        with span("blob.fs_read", prefix=prefix, conversation=conversation, turn=turn):
            rows = await self.db.candidates(prefix, conversation)
            scope = ReadScope.of(req.retained, turn)
            candidates = await self._in_scope(prefix, [c for c, _ in rows], conversation, scope)
            resolved = resolve_prefix(prefix, candidates, uniform=scope is not None)
            if not isinstance(resolved, Resolved):
                log.info("fs_read-refused", prefix=prefix, code=resolved["code"], conversation=conversation,
                         turn=turn, outside_scope=any(c.allowed for c, _ in rows))
                return resolved
            info = next(i for c, i in rows if c.sha256 == resolved.sha256)
            name = f"vfs_{prefix}.txt"
            indexed = await self._as_text(info, name, "fs_read", fs_read_error)
            if isinstance(indexed, dict):
                return indexed
            offset, column, total = req.offset, req.column, indexed.lines or 0
            if req.pattern is not None:
                # without a limit a search runs to the end of the text (a page's default limit does not apply)
                limit = req.limit if "limit" in req.model_fields_set else None
                return await self._search(indexed, name, req.pattern, offset, limit, total)
            return await self._lines(indexed, name, offset, lambda first: LinePager(
                first_line=first, offset=offset, limit=req.limit, total_lines=total, cap=self.cfg.read_cap,
                column=column))

    async def _search(self, indexed: BlobInfo, name: str, pattern: str, offset: int, limit: int | None,
                      total: int) -> dict[str, Any]:
        """fs_read with a pattern: the matching lines of [offset, offset + limit − 1] (default: to the end). The
        regex work runs off the event loop, bounded by one deadline for the whole read."""
        compiled = compile_pattern(pattern)
        if isinstance(compiled, dict):
            return compiled
        return await self._lines(indexed, name, offset, lambda first: LineSearch(
            compiled, first_line=first, offset=offset, limit=limit, total_lines=total, cap=self.cfg.read_cap,
            timeout_s=self.cfg.pattern_timeout_s), off_loop=True)

    async def _lines(self, indexed: BlobInfo, name: str, offset: int, pager_from: Callable[[int], _LinePaging],
                     *, off_loop: bool = False) -> dict[str, Any]:
        """The page (or search) of lines from line ``offset``: ``pager_from(first_line)`` builds the pager, first
        from line 1 (what it needs, or an answer without reading), then from the seek mark at or before
        ``offset``, fed only the text between that mark and the one after the page. ``off_loop``: feed it on a
        worker thread (regex work)."""
        pager = pager_from(1)
        if pager.done:
            return pager.result()
        line_marks, _ = await self._seek_marks(indexed)
        first_line, start = line_marks.floor(offset)
        end = line_marks.ceil_offset(pager.last + 1)
        end = indexed.size if end is None else end
        pager = pager_from(first_line)
        try:
            async for text in self._text(indexed, start, end - start):
                if await asyncio.to_thread(pager.feed, text) if off_loop else pager.feed(text):
                    break
        except ObjectGone:
            return fs_read_error("not-found", f"{name} is no longer available")
        return pager.result(at_end=end == indexed.size)

    async def _in_scope(self, prefix: str, candidates: list[Candidate], conversation: str,
                        scope: ReadScope | None) -> list[Candidate]:
        """The candidates with ``allowed`` narrowed to the read's scope: a retained URI or attachment, or a blob
        the turn itself references, or a member of a retained fold transcript — a folded row's output is still on
        the served path (SPEC §6, §15.2). No scope: the conversation-wide rule."""
        if scope is None or scope.retains_prefix(prefix) or not any(c.allowed for c in candidates):
            return candidates
        if await self.db.member_of(prefix, conversation, sorted(scope.prefixes)):
            return candidates
        owned = await self.db.turn_references([c.sha256 for c in candidates if c.allowed], conversation,
                                              scope.turn_id) if scope.turn_id else set()
        return [replace(c, allowed=c.allowed and c.sha256 in owned) for c in candidates]

    async def read_file(self, req: CtxBlobReadFileRequest) -> CtxBlobReadFileReply:
        """A character page of an attachment by handle (only this conversation's attachments)."""
        return CtxBlobReadFileReply.model_validate(await self._read_file(req))

    async def _read_file(self, req: CtxBlobReadFileRequest) -> dict[str, Any]:
        conversation, name, turn = req.conversationId, req.filename, req.turnId
        _texts_ok(conversation)
        scope = ReadScope.of(req.retained, turn)
        with span("blob.read_file", conversation=conversation, turn=turn):
            # a NUL can be in no handle (Postgres text cannot hold one): simply no such file
            found = None if "\x00" in name else await self.db.attachment(conversation, name)
            if found is not None and scope is not None and not scope.retains_attachment(found[0].handle,
                                                                                         found[0].sha256):
                log.info("read_file-refused", conversation=conversation, turn=turn, outside_scope=True)
                found = None  # revoked by the served window, or another branch's: as if it did not exist
            if found is None:
                known = list(scope.handles[:20]) if scope is not None \
                    else await self.db.attachment_handles(conversation)
                return read_file_not_found(name, known)
            indexed = await self._as_text(found[1], name, "read_file", read_file_error)
            if isinstance(indexed, dict):
                return indexed
            offset, limit = req.offset, req.limit
            total = indexed.chars or 0
            err = read_file_range_error(offset, total)
            if err is not None:
                return err
            _, char_marks = await self._seek_marks(indexed)
            first_char, start = char_marks.floor(offset)
            end = char_marks.ceil_offset(offset + limit)
            end = indexed.size if end is None else end
            pager = CharPager(first_char=first_char, offset=offset, limit=limit, total_chars=total)
            if not pager.done:
                try:
                    async for text in self._text(indexed, start, end - start):
                        if pager.feed(text):
                            break
                except ObjectGone:
                    return read_file_error("not-found", f"{name} is no longer available")
            return pager.result()

    async def _blob(self, sha: str, conv: str) -> BlobInfo | None:
        """The blob ``sha`` if it is stored (None if not), access-denied if the conversation may not read it."""
        found = await self.db.blob(sha, conv)
        if found is None:
            return None
        info, allowed = found
        if not allowed:
            raise ServiceError(f"blob {sha} is not readable from this conversation", code=ACCESS_DENIED)
        return info

    async def _readable(self, req: CtxBlobGetRequest1 | CtxBlobGetRequest2) -> BlobInfo:
        """The blob a caller names by sha256 or URI, if its conversation may read it (typed errors if not)."""
        _texts_ok(req)
        conv = req.conversationId
        if req.sha256 is not None:
            info = await self._blob(req.sha256, conv)
            if info is None:
                raise NotFound(f"no blob {req.sha256}")
            return info
        prefix = handle_prefix_from_uri(req.uri or "")
        if prefix is None:
            raise InvalidPayload("uri is not a stored-output URI (context://vfs/vfs_<16 hex>.txt)")
        rows = await self.db.candidates(prefix, conv)
        resolved = resolve_prefix(prefix, [c for c, _ in rows])
        if isinstance(resolved, Resolved):
            return next(i for c, i in rows if c.sha256 == resolved.sha256)
        code, message = resolved["code"], resolved["message"]
        if code == "not-found":
            raise NotFound(message)
        raise ServiceError(message, code=ACCESS_DENIED if code == ACCESS_DENIED else AMBIGUOUS_HANDLE)

    async def get(self, request: CtxBlobGetRequest) -> CtxBlobGetReply:
        """Read back a blob (or a byte range) by sha256 or URI: the bytes are pushed to the caller's `sink`
        inbox in chunks ≤ 512 KiB (allow-list enforced here)."""
        if self.transfer is None:
            raise DependencyUnavailable("no data channel configured")
        req = request.root
        if not INBOX.fullmatch(req.sink):
            raise InvalidPayload("sink must be a NATS inbox of the caller (_INBOX.…)")
        start, want = req.offset or 0, req.length
        piece = self.transfer.push_bytes(req.maxChunk)
        early: asyncio.Task | None = None
        sha = req.sha256
        if sha and start == 0 and want != 0 and (self.cache is None or self.cache.get(sha) is None):
            # start the S3 read (the request and up to two chunks, one thread hop: a 1 MiB blob is one large
            # chunk plus a small tail) while Postgres checks the allow-list; nothing is sent before it passes
            ahead = 2 * piece if want is None else min(2 * piece, want)
            early = self.s3.open_soon(object_key(sha), 0, want, prefetch=ahead)
        try:
            info = await self._readable(req)
        except BaseException:
            if early is not None:
                early.add_done_callback(_close_reader)
            raise
        if start > info.size:
            if early is not None:
                early.add_done_callback(_close_reader)
            raise InvalidPayload(f"offset {start} is past the end of the blob ({info.size} bytes)")
        length = info.size - start if want is None else min(want, info.size - start)
        with span("blob.get", sha256=info.sha256, start=start, length=length):
            if early is not None:
                reader = await early
                if reader is None:
                    raise NotFound(f"blob {info.sha256} is no longer available")
                chunks = _reader_chunks(reader, length, piece)
            else:
                chunks = self._bytes(info, start, length, piece, stream=True)
            try:
                try:
                    first = await anext(chunks, None)
                except ObjectGone as exc:  # before anything was sent: a clean not-found
                    raise NotFound(f"blob {info.sha256} is no longer available") from exc

                async def all_chunks() -> AsyncIterator[bytes]:
                    if first is not None:
                        yield first
                        async for c in chunks:
                            yield c

                n = await self.transfer.push(req.sink, all_chunks(), start, await_tail=not req.earlyReply)
            except ObjectGone as exc:
                raise NotFound(f"blob {info.sha256} is no longer available") from exc
            finally:
                await chunks.aclose()
        return CtxBlobGetReply(sha256=info.sha256, size=info.size, offset=start, length=length, chunks=n,
                               mediaType=info.media_type)

    # ------------------------------------------------------------------------ read-back for a UI (SPEC §7)
    async def get_result(self, request: CtxBlobGetResultRequest) -> CtxBlobGetResultReply:
        """Read-back for a UI (SPEC §7): a persisted envelope inflated from its blobs (a gone blob degrades to
        its excerpt), or an in-flight offload's original output (SPEC §15.1), byte-identical."""
        # a blob the conversation may not read is access-denied; a result too large for one reply is too-large
        # (the blob client then streams the blobs and inflates on its side)
        from ctxbuild_codec import envelopes

        req = request.root
        conv = req.conversationId
        _texts_ok(conv)
        if req.offload is not None:
            output = await self._original_result(req.offload, conv)
            return CtxBlobGetResultReply(output=Output.model_validate(output), gone=[])
        assert req.envelope is not None
        envelope = dump(req.envelope)
        try:
            ids = envelopes.blob_ids(envelope)  # text blobs and, for non-text outputs, the original (§15.1)
        except envelopes.EnvelopeError as exc:
            raise InvalidPayload(str(exc)[:300]) from exc
        infos = {sha: await self._blob(sha, conv) for sha in ids}
        self._within_reply(sum(i.size for i in infos.values() if i is not None),
                           "the inflated result needs {} bytes of blobs", "stream the blobs with ctx.blob.get",
                           [(s, i.size) for s, i in infos.items() if i])
        texts: dict[str, str | None] = {}
        for sha, info in infos.items():
            texts[sha] = None
            if info is None:
                continue
            try:
                texts[sha] = (await self._whole_blob(info)).decode("utf-8")
            except (ObjectGone, UnicodeDecodeError):
                texts[sha] = None
        output = envelopes.inflate(envelope, texts)
        return CtxBlobGetResultReply(output=Output.model_validate(output),
                              gone=[s for s, t in texts.items() if t is None])

    def _within_reply(self, size: int, what: str, instead: str, blobs: list[tuple[str, int]]) -> None:
        """too-large when ``size`` bytes of blobs would not fit one get_result reply (``details.blobs``)."""
        if size > self.cfg.result_max_bytes:
            raise ServiceError(f"{what.format(size)}, over the {self.cfg.result_max_bytes}-byte reply budget; "
                               f"{instead}", code=TOO_LARGE,
                               details={"blobs": [{"sha256": s, "size": n} for s, n in blobs]})

    async def _whole_blob(self, info: BlobInfo) -> bytes:
        """All of a blob's bytes (ObjectGone when its object is missing)."""
        return b"".join([c async for c in self._bytes(info, 0, info.size, self.cfg.chunk_bytes)])

    async def _original_result(self, offload: Offload, conv: str) -> dict[str, Any]:
        """An in-flight offload's original output (``offload.original``, SPEC §15.1) read back byte-identical:
        a non-text output's whole JSON, or a json output's value. Its blob being gone is ``not-found`` (there is
        no excerpt of the original to degrade to: the served part holds what is left)."""
        from ctxbuild_codec import nontext

        original = offload.original
        if original is None:
            raise InvalidPayload("the offload record names no original output (offload.original)")
        sha = original.sha256
        info = await self._blob(sha, conv)
        if info is None:
            raise NotFound(f"blob {sha} is no longer available")
        self._within_reply(info.size, "the original output is {} bytes", "stream it with ctx.blob.get",
                           [(sha, info.size)])
        try:
            data = await self._whole_blob(info)
        except ObjectGone as exc:
            raise NotFound(f"blob {sha} is no longer available") from exc
        try:
            return nontext.read_back(original.of, original.type, data.decode("utf-8"))
        except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError: not an original this lane stored
            raise InvalidPayload(f"blob {sha} does not hold a tool output's JSON") from exc


def _feed(indexer: Indexer, chunks: list[bytes]) -> None:
    for c in chunks:
        indexer.feed(c)
    chunks.clear()


async def _reader_chunks(reader: ObjectReader, length: int, piece: int) -> AsyncIterator[bytes]:
    try:
        async for data in reader.pieces(length, piece):
            yield data
    finally:
        reader.close()


def _close_reader(task: asyncio.Task) -> None:
    """Drop a speculative read nobody will use (its response must not hold a pooled connection)."""
    if not task.cancelled() and task.exception() is None and task.result() is not None:
        task.result().close()
