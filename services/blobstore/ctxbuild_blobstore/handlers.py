"""NATS subjects of the blob store (queue group `blobstore`). Contracts are checked by `rpc`; each handler
is one call into :class:`BlobStore` (or the collector)."""

from __future__ import annotations

from typing import Any

from ctxbuild_platform.rpc import rpc
from faststream.nats import NatsBroker

from .collector import Collector
from .usecases import BlobStore

QUEUE = "blobstore"


def register(broker: NatsBroker, store: BlobStore, collector: Collector | None = None, *,
             max_workers: int = 16) -> None:
    @rpc(broker, "ctx.blob.put", queue=QUEUE, max_workers=max_workers)
    async def put(req: dict[str, Any]) -> dict[str, Any]:
        """Content-addressed put plus one reference (blob, owner, role) for a conversation (content inline:
        up to ~700 KB; larger content goes through ctx.blob.upload)."""
        return await store.put(req)

    @rpc(broker, "ctx.blob.upload", queue=QUEUE, max_workers=max_workers)
    async def upload(req: dict[str, Any]) -> dict[str, Any]:
        """Chunked put (claim check): the instance pulls the bytes from the caller's `source` inbox in chunks
        ≤ 512 KiB, hashes and indexes them as they stream into S3, then records metadata + the reference."""
        return await store.upload(req)

    @rpc(broker, "ctx.blob.attach", queue=QUEUE, max_workers=max_workers)
    async def attach(req: dict[str, Any]) -> dict[str, Any]:
        """Attachment upload: the display name becomes a handle unique in the conversation."""
        return await store.attach(req)

    @rpc(broker, "ctx.blob.ref", queue=QUEUE, max_workers=max_workers)
    async def ref(req: dict[str, Any]) -> dict[str, Any]:
        """One more reference to a blob the same conversation already references (no bytes travel)."""
        return await store.ref(req)

    @rpc(broker, "ctx.blob.release", queue=QUEUE, max_workers=max_workers)
    async def release(req: dict[str, Any]) -> dict[str, Any]:
        """Drop an owner's references; a blob left with none is collected after the grace period."""
        return await store.release(req)

    @rpc(broker, "ctx.blob.get", queue=QUEUE, max_workers=max_workers)
    async def get(req: dict[str, Any]) -> dict[str, Any]:
        """Read back a blob (or a byte range) by sha256 or URI: the bytes are pushed to the caller's `sink`
        inbox in chunks ≤ 512 KiB (allow-list enforced here)."""
        return await store.get(req)

    @rpc(broker, "ctx.blob.fs_read", queue=QUEUE, max_workers=max_workers)
    async def fs_read(req: dict[str, Any]) -> dict[str, Any]:
        """A numbered page of an offloaded output by URI (allow-list enforced here)."""
        return await store.fs_read(req)

    @rpc(broker, "ctx.blob.read_file", queue=QUEUE, max_workers=max_workers)
    async def read_file(req: dict[str, Any]) -> dict[str, Any]:
        """A character page of an attachment by handle (only this conversation's attachments)."""
        return await store.read_file(req)

    @rpc(broker, "ctx.blob.get_result", queue=QUEUE, max_workers=max_workers)
    async def get_result(req: dict[str, Any]) -> dict[str, Any]:
        """Read-back for a UI (SPEC §7): a persisted envelope inflated from its blobs (a gone blob degrades to
        its excerpt), or an in-flight offload's original output (SPEC §15.1), byte-identical."""
        return await store.get_result(req)

    if collector is not None:
        @rpc(broker, "ctx.blob.gc", queue=QUEUE, max_workers=2)
        async def gc(req: dict[str, Any]) -> dict[str, Any]:
            """Run one garbage-collection round now (it also runs in the background every gc_interval_s)."""
            return (await collector.run_once()).to_reply()
