"""Garbage collection against the real Postgres and S3 (the collector in-process, with a short grace period):
unreferenced blobs go, referenced ones stay, objects orphaned by a crash between object and metadata go, a
collector never deletes what a concurrent put is (re)referencing, abandoned uploads are cleaned up."""

import asyncio
import hashlib
import uuid

import pytest
from ctxbuild_blobclient import BlobClient
from ctxbuild_blobstore.adapters.migrate import apply_migrations
from ctxbuild_blobstore.adapters.postgres import Postgres
from ctxbuild_blobstore.adapters.s3 import ObjectStore
from ctxbuild_blobstore.app import BlobStore, Collector, Config
from ctxbuild_blobstore.domain.keys import object_key, temp_key
from ctxbuild_codec.models.subjects.ctx_blob_fs_read_request import CtxBlobFsReadRequest
from ctxbuild_codec.models.subjects.ctx_blob_put_request import CtxBlobPutRequest
from minio import Minio

pytestmark = pytest.mark.integration
GRACE = 1.0
ORPHAN_GRACE = 3.0


def uid() -> str:
    return uuid.uuid4().hex


@pytest.fixture(scope="module")
def client(start_service, rpc) -> BlobClient:
    start_service("blobstore")  # also migrates the schema
    return BlobClient(rpc)


@pytest.fixture
async def parts(stack, client):
    env = stack.env
    await apply_migrations(env["CTX_DATABASE_URL"])
    db = Postgres(env["CTX_DATABASE_URL"], max_size=30)
    await db.connect()
    s3 = ObjectStore(env["CTX_S3_ENDPOINT"], env["CTX_S3_ACCESS_KEY"], env["CTX_S3_SECRET_KEY"], env["CTX_S3_BUCKET"])
    gc = Collector(db, s3, grace_s=GRACE, upload_stale_s=GRACE)
    yield db, s3, gc, BlobStore(db, s3, config=Config())
    await db.close()


def has_object(minio: Minio, stack, key: str) -> bool:
    return any(True for _ in minio.list_objects(stack.env["CTX_S3_BUCKET"], prefix=key))


async def age(pg, sha: str, seconds: float) -> None:
    """Pretend the last reference went away ``seconds`` ago (instead of sleeping through the grace)."""
    await pg.execute("UPDATE blobstore.blobs SET unreferenced_since = now() - make_interval(secs => $2) "
                     "WHERE sha256 = $1 AND unreferenced_since IS NOT NULL", sha, seconds)


async def test_unreferenced_blobs_are_collected_after_the_grace_referenced_ones_never(client, parts, pg, minio,
                                                                                      stack):
    _db, _s3, gc, _ = parts
    conv = uid()
    kept = await client.put(f"kept {uid()}\n" * 50, conv, ("message", uid()), "tool_output")
    gone_owner = uid()
    gone = await client.put(f"gone {uid()}\n" * 50, conv, ("turn", gone_owner), "provisional")
    fresh_owner = uid()
    fresh = await client.put(f"fresh {uid()}\n" * 50, conv, ("turn", fresh_owner), "provisional")
    await client.release(("turn", gone_owner))
    await client.release(("turn", fresh_owner))
    await age(pg, gone["sha256"], 10)  # released long ago
    await pg.execute("UPDATE blobstore.blobs SET created_at = now() - interval '1 day' WHERE sha256 = $1",
                     kept["sha256"])  # old but referenced: no TTL on referenced blobs

    report = await gc.run_once()
    assert report.ran and report.blobs >= 1 and not report.errors
    assert await pg.fetchval("SELECT count(*) FROM blobstore.blobs WHERE sha256 = $1", gone["sha256"]) == 0
    assert not has_object(minio, stack, object_key(gone["sha256"]))
    page = await client.fs_read(conv, gone["uri"])
    assert page["code"] == "not-found"  # the metadata went first: never a half-present blob
    for alive in (kept, fresh):  # referenced, or released less than the grace ago
        assert has_object(minio, stack, object_key(alive["sha256"]))
        assert await pg.fetchval("SELECT count(*) FROM blobstore.blobs WHERE sha256 = $1", alive["sha256"]) == 1
    assert (await client.fs_read(conv, kept["uri"]))["kind"] == "text"


async def test_re_referencing_within_the_grace_saves_the_blob(client, parts, pg):
    _db, _s3, gc, _ = parts
    conv, owner = uid(), uid()
    text = f"revived {uid()}\n" * 30
    r = await client.put(text, conv, ("turn", owner), "provisional")
    await client.release(("turn", owner))
    await client.put(text, conv, ("message", uid()), "tool_output")  # the persist lane references it again
    await age(pg, r["sha256"], 10)  # no-op: unreferenced_since was cleared by the new reference
    await gc.run_once()
    assert (await client.get_text(conv, sha256=r["sha256"])) == text


async def test_an_object_orphaned_between_object_and_metadata_is_collected(client, parts, minio, stack, pg):
    db, s3, _, _ = parts
    # S3 listings may give an object's time to the whole second: with a 1 s grace an object written late in a second
    # could already look older than the grace at the first round, on a slow machine; the grace here outlasts that
    gc = Collector(db, s3, grace_s=ORPHAN_GRACE, upload_stale_s=ORPHAN_GRACE)
    # what a crash right after the object write leaves: an object, no row (the real crash: test_blobstore_failures)
    text = f"orphan {uid()}\n"
    sha = hashlib.sha256(text.encode()).hexdigest()
    await s3.put(object_key(sha), text.encode())
    young_sha = hashlib.sha256(b"young" + uid().encode()).hexdigest()
    report = await gc.run_once()
    assert has_object(minio, stack, object_key(sha))  # younger than the grace: a put may still be in flight
    await asyncio.sleep(ORPHAN_GRACE + 0.2)
    await s3.put(object_key(young_sha), b"young")
    report = await gc.run_once()
    assert report.orphans >= 1
    assert not has_object(minio, stack, object_key(sha))
    assert has_object(minio, stack, object_key(young_sha))
    # the same content put again afterwards is stored whole (object + row), never a row without its object
    conv = uid()
    r = await client.put(text, conv, ("message", uid()), "tool_output")
    assert r["created"] and has_object(minio, stack, object_key(sha))
    assert await client.get_text(conv, sha256=sha) == text
    await s3.remove(object_key(young_sha))


async def test_gc_never_deletes_what_a_concurrent_put_is_re_referencing(parts, pg, minio, stack):
    db, _s3, gc, store = parts
    conv = uid()
    text = f"contended {uid()}\n" * 20
    sha = hashlib.sha256(text.encode()).hexdigest()
    owner = uid()
    await store.put(CtxBlobPutRequest.model_validate({"content": text, "conversationId": conv,
                                                      "owner": {"kind": "turn", "id": owner}, "role": "provisional"}))
    await db.release("turn", owner)
    await age(pg, sha, 10)
    # a put holds the blob's shared lock from its existence check to its metadata commit: GC skips the blob
    async with db.blob_lock(sha) as blob:
        assert await blob.exists()
        report = await gc.run_once()
        assert report.skipped >= 1
        await blob.record(None, store_ref(conv), None)
    await gc.run_once()
    assert has_object(minio, stack, object_key(sha))
    assert await pg.fetchval("SELECT count(*) FROM blobstore.refs WHERE sha256 = $1", sha) == 1

    # and a hammering race on content nothing else holds: puts, releases and GC rounds interleaved. Whenever a
    # put has returned, its blob is readable in full; at the end every row still has its object.
    churned = f"churned {uid()}\n" * 20
    csha = hashlib.sha256(churned.encode()).hexdigest()
    pg_lock = asyncio.Lock()
    reads: list[bool] = []

    async def churn() -> None:
        for _ in range(6):
            o = uid()
            await store.put(CtxBlobPutRequest.model_validate({"content": churned, "conversationId": conv,
                                                              "owner": {"kind": "turn", "id": o},
                                                              "role": "provisional"}))
            page = await store.fs_read(CtxBlobFsReadRequest(conversationId=conv,
                                                            uri=f"context://vfs/vfs_{csha[:16]}.txt"))
            reads.append(page.root.kind == "text")
            await db.release("turn", o)
            async with pg_lock:
                await age(pg, csha, 10)

    async def collect() -> None:
        for _ in range(12):
            await gc.run_once()
            await asyncio.sleep(0.01)

    await asyncio.gather(*(churn() for _ in range(4)), collect())
    assert reads and all(reads)
    row = await pg.fetchval("SELECT count(*) FROM blobstore.blobs WHERE sha256 = $1", csha)
    assert row == 0 or has_object(minio, stack, object_key(csha))


def store_ref(conv):
    from ctxbuild_blobstore.adapters.postgres import RefSpec

    return RefSpec("message", uid(), "tool_output", conv)


async def test_abandoned_uploads_and_staging_objects_are_cleaned(parts, minio, stack):
    _db, s3, gc, _ = parts
    bucket = stack.env["CTX_S3_BUCKET"]
    key = temp_key(uid())
    upload_id = await s3.create_multipart(key)
    await s3.upload_part(key, upload_id, 1, b"x" * 1024)
    staging = temp_key(uid())
    await s3.put(staging, b"left behind by a crash between complete and copy")
    await asyncio.sleep(GRACE + 0.2)
    report = await gc.run_once()
    assert report.uploads >= 1 and report.staging >= 1
    assert not list(minio._list_multipart_uploads(bucket, prefix=key).uploads)
    assert not has_object(minio, stack, staging)


async def test_one_collector_at_a_time(parts):
    db, _s3, gc, _ = parts
    async with db.gc_leader() as leader:
        assert leader
        report = await gc.run_once()  # another replica is collecting: this one does nothing
        assert report.ran is False


async def test_gc_subject_runs_a_round(client):
    r = await client.gc()
    assert r["ran"] in (True, False) and r["errors"] == []
