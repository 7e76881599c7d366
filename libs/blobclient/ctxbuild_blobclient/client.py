"""BlobClient: the blob store as its callers see it (truncation, persistence, orchestration, a UI backend).

- ``put`` / ``attach`` pick the path: content that fits one NATS message goes inline (``ctx.blob.put`` /
  ``ctx.blob.attach``); anything larger, or a stream, goes through ``ctx.blob.upload``: the serving instance
  *pulls* the bytes from a private inbox of this client, chunk by chunk (claim check; see the service README).
  A ``str`` is hashed first (slice by slice), so content the conversation already holds costs no transfer.
- ``iter_chunks`` / ``get_bytes`` / ``get_text`` read a blob back: the instance *pushes* chunks to a private inbox,
  each acknowledged when this client takes it, so memory stays bounded on both sides.
- ``fs_read`` / ``read_file`` / ``ref`` / ``release`` / ``gc`` are the plain request/reply subjects.

Failures raise :class:`ctxbuild_platform.errors.RemoteError` with the service's typed code (``unavailable`` and
``timeout`` are retryable). Memory: an upload holds one chunk (≤ 512 KiB) plus what the caller's iterator holds;
a read holds at most the service's window of chunks unless the caller keeps them (``get_text`` does, by design).
"""

from __future__ import annotations

import asyncio
import codecs
import hashlib
import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from ctxbuild_platform.errors import RemoteError
from ctxbuild_platform.rpc import RpcClient
from nats.errors import MaxPayloadError

from .chunks import Content, Rechunker, digest_str, pieces

ERROR_HEADER = "Ctx-Blob-Error"
OFFSET_HEADER = "Ctx-Blob-Offset"
INLINE_MAX_BYTES = 768 * 1024  # request JSON must stay under NATS max_payload (1 MB locally)
LONG_CALL_S = 24 * 3600.0  # transfers are bounded by the idle watchdog, not by one overall deadline
CHUNK_BYTES = 512 * 1024  # what iter_chunks yields at most
HEADER_ROOM = 4096  # a pushed chunk carries headers; HPUB counts headers + payload against max_payload


def _owner(owner: Mapping[str, str] | tuple[str, str]) -> dict[str, str]:
    if isinstance(owner, tuple):
        kind, oid = owner
        return {"kind": kind, "id": oid}
    return {"kind": owner["kind"], "id": owner["id"]}


class BlobClient:
    def __init__(self, rpc: RpcClient, *, inline_max_bytes: int = INLINE_MAX_BYTES, idle_timeout_s: float = 30.0,
                 commit_timeout_s: float = 120.0, timeout_s: float | None = None,
                 prehash_min_bytes: int = 4 * 1024 * 1024) -> None:
        self.rpc = rpc
        self.prehash_min_bytes = prehash_min_bytes
        self.inline_max_bytes = inline_max_bytes
        self.idle_timeout_s = idle_timeout_s  # no chunk asked/pushed for this long: the service is gone
        self.commit_timeout_s = commit_timeout_s  # after the last chunk: the service stores and records
        self.timeout_s = timeout_s  # plain request/reply subjects (None: the RpcClient's default)

    @property
    def _nc(self):
        return self.rpc.broker.connection

    # ------------------------------------------------------------------ writes
    async def put(self, content: Content, conversation_id: str, owner: Mapping[str, str] | tuple[str, str],
                  role: str, *, media_type: str | None = None, sha256: str | None = None,
                  size: int | None = None, members: Sequence[str] | None = None) -> dict[str, Any]:
        """Store content with one reference (blob, owner, role); returns ``{sha256, uri, handle, size, created,
        …}``. ``content``: str, bytes, or a (sync or async) iterable of str/bytes pieces (streamed). ``members``:
        a fold transcript's archived-output URIs, readable while the transcript is in a read's retained context."""
        base: dict[str, Any] = {"conversationId": conversation_id, "owner": _owner(owner), "role": role}
        if media_type:
            base["mediaType"] = media_type
        if members:
            base["members"] = list(dict.fromkeys(members))
        inline = self._inline_text(content)
        if inline is not None:
            try:  # a declared hash is checked by the store on this path too (a mismatch is invalid-payload)
                return await self._call("ctx.blob.put", {"content": inline, **base,
                                                         **({"sha256": sha256} if sha256 else {})})
            except MaxPayloadError:
                pass  # escaping made the JSON too big: stream it instead
        return await self._upload(content, base, sha256=sha256, size=size)

    async def attach(self, content: Content, conversation_id: str, display_name: str,
                     media_type: str = "text/plain") -> dict[str, Any]:
        """An attachment with a handle unique in the conversation; the reply has the ``ctx.blob.attach`` shape
        ``{sha256, uri, handle, displayName, size, mediaType}`` whichever path was taken."""
        inline = self._inline_text(content)
        if inline is not None:
            try:
                return await self._call("ctx.blob.attach", {"conversationId": conversation_id,
                                                            "displayName": display_name, "content": inline,
                                                            "mediaType": media_type})
            except MaxPayloadError:
                pass
        r = await self._upload(content, {"conversationId": conversation_id,
                                         "attachment": {"displayName": display_name, "mediaType": media_type}})
        att = r["attachment"]
        return {"sha256": r["sha256"], "uri": r["uri"], "handle": att["handle"], "displayName": att["displayName"],
                "size": r["size"], "mediaType": att["mediaType"]}

    def _inline_text(self, content: Content) -> str | None:
        """The content as a str when it is small enough (and text) to travel inline."""
        if isinstance(content, str):
            # cheap bounds first: n chars are between n and 4n UTF-8 bytes
            if len(content) > self.inline_max_bytes:
                return None
            if len(content) * 4 <= self.inline_max_bytes:
                return content
            try:
                return content if len(content.encode("utf-8")) <= self.inline_max_bytes else None
            except UnicodeEncodeError:
                return content  # the service answers invalid-payload, as for any lone surrogate
        if isinstance(content, (bytes, bytearray, memoryview)) and len(content) <= self.inline_max_bytes:
            try:
                return bytes(content).decode("utf-8")
            except UnicodeDecodeError:
                return None  # binary: only the upload path stores it as is
        return None

    async def ref(self, sha256: str, conversation_id: str, owner: Mapping[str, str] | tuple[str, str],
                  role: str) -> dict[str, Any]:
        return await self._call("ctx.blob.ref", {"sha256": sha256, "conversationId": conversation_id,
                                                 "owner": _owner(owner), "role": role})

    async def release(self, owner: Mapping[str, str] | tuple[str, str], role: str | None = None,
                      sha256: str | None = None) -> int:
        req: dict[str, Any] = {"owner": _owner(owner)}
        if role:
            req["role"] = role
        if sha256:
            req["sha256"] = sha256
        return int((await self._call("ctx.blob.release", req))["released"])

    async def gc(self) -> dict[str, Any]:
        return await self._call("ctx.blob.gc", {}, timeout=300)

    async def _call(self, subject: str, payload: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        return await self.rpc.call(subject, payload, timeout=timeout or self.timeout_s)

    async def _upload(self, content: Content, base: dict[str, Any], *, sha256: str | None = None,
                      size: int | None = None) -> dict[str, Any]:
        subject = "ctx.blob.upload"
        # declaring the hash up front lets content the conversation already holds skip the transfer; worth a
        # hashing pass only when the transfer would cost more than the pass
        prehash = self.prehash_min_bytes
        if isinstance(content, str) and sha256 is None and len(content) >= prehash:
            try:
                sha256, size = digest_str(content)
            except UnicodeEncodeError as exc:
                raise RemoteError(subject, "invalid-payload", f"content is not valid Unicode text: {exc.reason}",
                                  False) from exc
        elif isinstance(content, (bytes, bytearray, memoryview)) and sha256 is None and len(content) >= prehash:
            sha256, size = hashlib.sha256(content).hexdigest(), len(content)
        req = dict(base)
        if sha256 is not None:
            req["sha256"] = sha256
        if size is not None:
            req["size"] = size

        nc = self._nc
        inbox = nc.new_inbox()
        source = Rechunker(pieces(content))
        loop = asyncio.get_running_loop()
        state: dict[str, Any] = {"next": 0, "eof": False, "error": None, "watchdog": None}

        async def on_pull(msg) -> None:
            try:
                ask = json.loads(msg.data)
                # as much as the service asks for, never more than one message of our own connection
                seq, most = int(ask["seq"]), min(int(ask["max"]), nc.max_payload)
                if seq != state["next"]:
                    raise ValueError(f"pull for chunk {seq}, expected {state['next']}")
                state["next"] += 1
                chunk = b"" if state["eof"] else await source.next(most)
                if not chunk:
                    state["eof"] = True
                await nc.publish(msg.reply, chunk)
            except Exception as exc:  # noqa: BLE001 - the service must hear about it, the caller too
                state["error"] = state["error"] or exc
                await nc.publish(msg.reply, b"", headers={ERROR_HEADER: f"{type(exc).__name__}: {exc}"[:300]})
            finally:
                watchdog = state["watchdog"]
                if watchdog is not None and not watchdog.expired():  # the service is talking: push the deadline
                    watchdog.reschedule(loop.time() + (self.commit_timeout_s if state["eof"] else self.idle_timeout_s))

        sub = await nc.subscribe(inbox, cb=on_pull)
        try:
            # no overall deadline: the call fails once the service has been quiet too long (idle_timeout_s while
            # it pulls, commit_timeout_s after the last chunk, while it stores and records)
            async with asyncio.timeout(self.idle_timeout_s) as watchdog:
                state["watchdog"] = watchdog
                return await self.rpc.call(subject, {**req, "source": inbox}, timeout=LONG_CALL_S)
        except TimeoutError as exc:
            raise RemoteError(subject, "unavailable", "the blob store went quiet for "
                              f"{self.commit_timeout_s if state['eof'] else self.idle_timeout_s:g}s", True) from exc
        except RemoteError as exc:
            if state["error"] is not None:
                raise state["error"] from exc  # the caller's own iterator failed: that is the error to see
            raise
        finally:
            state["watchdog"] = None
            await sub.unsubscribe()

    # ------------------------------------------------------------------ reads
    async def iter_chunks(self, conversation_id: str, *, sha256: str | None = None, uri: str | None = None,
                          offset: int = 0, length: int | None = None) -> AsyncIterator[bytes]:
        """The blob's bytes (or ``[offset, offset+length)``) in chunks ≤ 512 KiB. A whole-blob read is verified
        against its sha256 before the generator finishes (``digest-mismatch`` otherwise). Use it to the end or
        close it (``contextlib.aclosing``)."""
        async for c in self._chunks(conversation_id, sha256=sha256, uri=uri, offset=offset, length=length):
            yield c

    async def _chunks(self, conversation_id: str, *, sha256: str | None = None, uri: str | None = None,
                      offset: int = 0, length: int | None = None, large: bool = False) -> AsyncIterator[bytes]:
        """iter_chunks; ``large``: accept chunks up to one message of this connection (fewer, larger messages;
        for callers that join or decode the chunks anyway)."""
        subject = "ctx.blob.get"
        if (sha256 is None) == (uri is None):
            raise ValueError("pass exactly one of sha256 or uri")
        req: dict[str, Any] = {"conversationId": conversation_id, "offset": offset}
        req.update({"sha256": sha256} if sha256 else {"uri": uri})
        if length is not None:
            req["length"] = length
        nc = self._nc
        if large and nc.max_payload - HEADER_ROOM > CHUNK_BYTES:
            req["maxChunk"] = nc.max_payload - HEADER_ROOM
        req["earlyReply"] = True  # this loop reads chunks up to the replied length even after the reply
        inbox = nc.new_inbox()
        req["sink"] = inbox
        queue: asyncio.Queue = asyncio.Queue()
        state = {"active": time.monotonic()}

        async def on_chunk(msg) -> None:
            state["active"] = time.monotonic()
            queue.put_nowait(msg)

        sub = await nc.subscribe(inbox, cb=on_chunk)
        call = asyncio.ensure_future(self.rpc.call(subject, req, timeout=LONG_CALL_S))
        hasher = hashlib.sha256() if offset == 0 and length is None else None
        expect = offset
        result: dict[str, Any] | None = None  # the reply; with early replies it may overtake the last chunks
        getter: asyncio.Future | None = None
        try:
            while True:
                if result is not None and expect >= result["offset"] + result["length"]:
                    if expect != result["offset"] + result["length"]:
                        raise RemoteError(subject, "transfer-aborted",
                                          f"received up to byte {expect}, the service sent "
                                          f"{result['offset'] + result['length']}", True)
                    if hasher is not None and hasher.hexdigest() != result["sha256"]:
                        raise RemoteError(subject, "digest-mismatch",
                                          f"read-back does not hash to {result['sha256']}", False)
                    return
                if getter is None:
                    getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter} if result is not None else {getter, call},
                                             timeout=self.idle_timeout_s, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    msg, getter = getter.result(), None
                    at = int((msg.headers or {}).get(OFFSET_HEADER, -1))
                    if at != expect:
                        await nc.publish(msg.reply, b"", headers={ERROR_HEADER: "out of order"})
                        raise RemoteError(subject, "transfer-aborted", f"chunk at {at}, expected {expect}", True)
                    await nc.publish(msg.reply, b"")  # ack: the service may send the next one
                    expect += len(msg.data)
                    if hasher is not None:
                        hasher.update(msg.data)
                    yield msg.data
                    continue
                if result is None and call in done:
                    result = call.result()  # raises RemoteError for a typed error reply
                    continue
                if time.monotonic() - state["active"] > self.idle_timeout_s:
                    raise RemoteError(subject, "unavailable",
                                      f"no data from the blob store for {self.idle_timeout_s:g}s", True)
        finally:
            if getter is not None:
                getter.cancel()
            if not call.done():
                call.cancel()
            await asyncio.gather(call, return_exceptions=True)
            await sub.unsubscribe()

    async def get_bytes(self, conversation_id: str, *, sha256: str | None = None, uri: str | None = None,
                        offset: int = 0, length: int | None = None) -> bytes:
        parts = [c async for c in self._chunks(conversation_id, sha256=sha256, uri=uri, offset=offset,
                                               length=length, large=True)]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def get_text(self, conversation_id: str, *, sha256: str | None = None, uri: str | None = None) -> str:
        """The whole blob as text (strict UTF-8)."""
        dec = codecs.getincrementaldecoder("utf-8")("strict")
        parts = [dec.decode(c) async for c in self._chunks(conversation_id, sha256=sha256, uri=uri, large=True)]
        parts.append(dec.decode(b"", final=True))
        return "".join(parts)

    async def iter_text(self, conversation_id: str, *, sha256: str | None = None,
                        uri: str | None = None) -> AsyncIterator[str]:
        """The whole blob as text, piece by piece (bounded memory); chunk borders inside a character are fine."""
        dec = codecs.getincrementaldecoder("utf-8")("strict")
        async for c in self._chunks(conversation_id, sha256=sha256, uri=uri, large=True):
            if t := dec.decode(c):
                yield t
        if t := dec.decode(b"", final=True):
            yield t

    async def get_result(self, conversation_id: str, envelope: Mapping[str, Any] | None = None, *,
                         offload: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Read-back for a UI: the persisted envelope inflated to the original output ``{output, gone}``, or the
        original output an in-flight ``offload`` record names (``offload.original``, SPEC §15.1). When the result
        is too large for one reply, the blobs are streamed here and inflated with the same codec."""
        req: dict[str, Any] = {"conversationId": conversation_id}
        if offload is not None:
            req["offload"] = dict(offload)
        else:
            req["envelope"] = dict(envelope or {})
        try:
            return await self._call("ctx.blob.get_result", req)
        except RemoteError as exc:
            if exc.code != "too-large":
                raise
        from ctxbuild_codec import envelopes, nontext

        if offload is not None:
            original = offload["original"]
            text = await self.get_text(conversation_id, sha256=original["sha256"])
            return {"output": nontext.read_back(original["of"], original["type"], text), "gone": []}
        assert envelope is not None
        texts: dict[str, str | None] = {}
        for sha in envelopes.blob_ids(envelope):
            if sha in texts:
                continue
            try:
                texts[sha] = await self.get_text(conversation_id, sha256=sha)
            except RemoteError as exc:
                if exc.code != "not-found":
                    raise
                texts[sha] = None
        return {"output": envelopes.inflate(envelope, texts), "gone": [s for s, t in texts.items() if t is None]}

    async def fs_read(self, conversation_id: str, uri: str, offset: int = 1, limit: int = 2000,
                      turn_id: str | None = None) -> dict[str, Any]:
        req: dict[str, Any] = {"conversationId": conversation_id, "uri": uri, "offset": offset, "limit": limit}
        if turn_id:
            req["turnId"] = turn_id
        return await self._call("ctx.blob.fs_read", req)

    async def read_file(self, conversation_id: str, filename: str, offset: int = 0,
                        limit: int = 8000) -> dict[str, Any]:
        return await self._call("ctx.blob.read_file", {"conversationId": conversation_id, "filename": filename,
                                                       "offset": offset, "limit": limit})
