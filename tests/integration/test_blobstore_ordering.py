"""The write path overlaps its steps; these tests pin down what may never overlap.

A put runs its metadata INSERT while the object is being written to S3 (both inside the blob lock's transaction),
so the invariant "metadata ⇒ object" now rests on the commit coming after the write. The S3 adapter here is the
real one (real SeaweedFS) with its PUT held at a gate the test opens — then done for real, or failed.
And a request to the blob store continues its caller's trace, into the service and back in the reply."""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid

import pytest
from ctxbuild_blobstore.adapters.migrate import apply_migrations
from ctxbuild_blobstore.adapters.postgres import Postgres
from ctxbuild_blobstore.adapters.s3 import CONTENT_TYPE, ObjectStore
from ctxbuild_blobstore.app import BlobStore, Config
from ctxbuild_blobstore.domain.keys import object_key
from ctxbuild_codec.contract_models import dump
from ctxbuild_codec.models.subjects.ctx_blob_fs_read_request import CtxBlobFsReadRequest
from ctxbuild_codec.models.subjects.ctx_blob_put_request import CtxBlobPutRequest
from ctxbuild_codec.trim import vfs_uri
from ctxbuild_platform.errors import DependencyUnavailable
from ctxbuild_platform.telemetry import TracingMiddleware
from faststream.nats import NatsBroker
from opentelemetry.sdk.trace import TracerProvider

pytestmark = pytest.mark.integration


def uid() -> str:
    return uuid.uuid4().hex


class GatedObjectStore(ObjectStore):
    """The real S3 adapter; a PUT waits at a gate the test opens, then goes to S3 — or fails, if told to."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()
        self.fail = False

    async def put(self, key: str, data: bytes, content_type: str = CONTENT_TYPE) -> None:
        self.entered.set()
        await self.gate.wait()
        if self.fail:
            raise DependencyUnavailable("s3: put_object failed: injected by the test")
        await super().put(key, data, content_type)


@pytest.fixture
async def gated(stack):
    env = stack.env
    await apply_migrations(env["CTX_DATABASE_URL"])
    db = Postgres(env["CTX_DATABASE_URL"])
    await db.connect()
    s3 = GatedObjectStore(env["CTX_S3_ENDPOINT"], env["CTX_S3_ACCESS_KEY"], env["CTX_S3_SECRET_KEY"],
                          env["CTX_S3_BUCKET"])
    yield s3, BlobStore(db, s3, config=Config())
    s3.gate.set()
    await db.close()


async def wait_for_staged_insert(pg) -> None:
    """Until another session holds the blobs table's row lock and sits idle in its transaction: the writer's
    INSERT has run and the writer now waits for its object write."""
    for _ in range(500):
        staged = await pg.fetchval(
            "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
            "JOIN pg_stat_activity a ON a.pid = l.pid WHERE c.relname = 'blobs' AND l.mode = 'RowExclusiveLock' "
            "AND l.pid <> pg_backend_pid() AND a.state = 'idle in transaction'")
        if staged:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the writer's INSERT never ran while its object write was held")


def put_request(text: str, conv: str) -> CtxBlobPutRequest:
    return CtxBlobPutRequest.model_validate({"content": text, "conversationId": conv,
                                             "owner": {"kind": "message", "id": uid()}, "role": "tool_output"})


async def fs_read(store: BlobStore, **req) -> dict:
    """``ctx.blob.fs_read``'s use case, its reply as on the wire."""
    return dump(await store.fs_read(CtxBlobFsReadRequest(**req)))


async def test_metadata_staged_during_the_object_write_is_invisible_until_the_object_exists(gated, pg, minio,
                                                                                          stack):
    s3, store = gated
    conv = uid()
    text = f"staged {uid()}\n" * 200
    sha = hashlib.sha256(text.encode()).hexdigest()
    writing = asyncio.create_task(store.put(put_request(text, conv)))
    await asyncio.wait_for(s3.entered.wait(), 10)
    await wait_for_staged_insert(pg)
    # the row exists only inside the writer's transaction: no reader can see it, through SQL or the service
    assert await pg.fetchval("SELECT count(*) FROM blobstore.blobs WHERE sha256 = $1", sha) == 0
    assert await pg.fetchval("SELECT count(*) FROM blobstore.refs WHERE sha256 = $1", sha) == 0
    page = await fs_read(store, conversationId=conv, uri=vfs_uri(sha))
    assert page["kind"] == "error" and page["code"] == "not-found"
    assert not list(minio.list_objects(stack.env["CTX_S3_BUCKET"], prefix=object_key(sha)))

    s3.gate.set()
    reply = await asyncio.wait_for(writing, 20)
    assert reply.created and reply.sha256 == sha
    assert list(minio.list_objects(stack.env["CTX_S3_BUCKET"], prefix=object_key(sha)))
    assert await pg.fetchval("SELECT count(*) FROM blobstore.blobs WHERE sha256 = $1", sha) == 1
    page = await fs_read(store, conversationId=conv, uri=vfs_uri(sha), limit=1)
    assert page["kind"] == "text" and page["text"].endswith(text.splitlines()[0])


async def test_a_failed_object_write_rolls_back_the_metadata_staged_beside_it(gated, pg, minio, stack):
    s3, store = gated
    conv = uid()
    text = f"never stored {uid()}\n" * 200
    sha = hashlib.sha256(text.encode()).hexdigest()
    s3.fail = True
    writing = asyncio.create_task(store.put(put_request(text, conv)))
    await asyncio.wait_for(s3.entered.wait(), 10)
    await wait_for_staged_insert(pg)
    s3.gate.set()
    with pytest.raises(DependencyUnavailable):
        await asyncio.wait_for(writing, 20)
    for table in ("blobs", "refs", "blob_index"):
        assert await pg.fetchval(f"SELECT count(*) FROM blobstore.{table} WHERE sha256 = $1", sha) == 0
    assert not list(minio.list_objects(stack.env["CTX_S3_BUCKET"], prefix=object_key(sha)))
    # the lock went with the transaction: the same content stores normally afterwards
    s3.fail = False
    again = await store.put(put_request(text, conv))
    assert again.created and await pg.fetchval("SELECT count(*) FROM blobstore.blobs WHERE sha256 = $1",
                                                  sha) == 1


async def test_a_request_continues_the_callers_trace_into_the_service_and_back(start_service, stack):
    start_service("blobstore")
    provider = TracerProvider()
    broker = NatsBroker(stack.env["CTX_NATS_URL"], logger=None,
                        middlewares=[TracingMiddleware(tracer_provider=provider)])
    await broker.connect()
    try:
        with provider.get_tracer("test").start_as_current_span("turn") as caller:
            trace_id = format(caller.get_span_context().trace_id, "032x")
            reply = await broker.request(json.dumps({"conversationId": uid(), "uri": "not-a-uri"}).encode(),
                                         "ctx.blob.fs_read", timeout=10,
                                         headers={"content-type": "application/json"})
        assert json.loads(reply.body)["result"]["code"] == "parse-error"  # validated, handled, replied
        version, tid, parent, _flags = reply.headers["traceparent"].split("-")
        # the reply carries the service's span for this request: same trace, a span of its own
        assert version == "00" and tid == trace_id
        assert parent != format(caller.get_span_context().span_id, "016x")
    finally:
        await broker.stop()
