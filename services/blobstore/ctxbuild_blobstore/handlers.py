"""NATS subjects of the blob store (queue group `blobstore`). Contracts are checked by `rpc`; each handler
is one call into :class:`BlobStore`."""

from __future__ import annotations

from typing import Any

from ctxbuild_platform.rpc import rpc
from faststream.nats import NatsBroker

from .usecases import BlobStore

QUEUE = "blobstore"


def register(broker: NatsBroker, store: BlobStore, *, max_workers: int = 16) -> None:
    @rpc(broker, "ctx.blob.put", queue=QUEUE, max_workers=max_workers)
    async def put(req: dict[str, Any]) -> dict[str, Any]:
        """Content-addressed put plus one reference (blob, owner, role) for a conversation."""
        return await store.put(req)

    @rpc(broker, "ctx.blob.attach", queue=QUEUE, max_workers=max_workers)
    async def attach(req: dict[str, Any]) -> dict[str, Any]:
        """Attachment upload: the display name becomes a handle unique in the conversation."""
        return await store.attach(req)

    @rpc(broker, "ctx.blob.fs_read", queue=QUEUE, max_workers=max_workers)
    async def fs_read(req: dict[str, Any]) -> dict[str, Any]:
        """A numbered page of an offloaded output by URI (allow-list enforced here)."""
        return await store.fs_read(req)

    @rpc(broker, "ctx.blob.read_file", queue=QUEUE, max_workers=max_workers)
    async def read_file(req: dict[str, Any]) -> dict[str, Any]:
        """A character page of an attachment by handle (only this conversation's attachments)."""
        return await store.read_file(req)
