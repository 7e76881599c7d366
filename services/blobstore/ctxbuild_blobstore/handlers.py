"""NATS subjects of the blob store (queue group `blobstore`). Each subject is one use case of :class:`BlobStore`
(or the collector), typed by the subject's generated request and reply models: ``rpc`` validates and parses the
request (decode), the use case runs, ``rpc`` dumps and validates its reply (encode). A use case's docstring is the
subject's description in the AsyncAPI document."""

from __future__ import annotations

from ctxbuild_platform.rpc import rpc
from faststream.nats import NatsBroker

from .app import BlobStore, Collector

QUEUE = "blobstore"
USE_CASES = {f"ctx.blob.{name}": name for name in
             ("put", "upload", "attach", "ref", "release", "get", "fs_read", "read_file", "get_result")}


def register(broker: NatsBroker, store: BlobStore, collector: Collector | None = None, *,
             max_workers: int = 16) -> None:
    for subject, use_case in USE_CASES.items():
        rpc(broker, subject, queue=QUEUE, max_workers=max_workers)(getattr(store, use_case))
    if collector is not None:
        rpc(broker, "ctx.blob.gc", queue=QUEUE, max_workers=2)(collector.gc)
