"""Failure behaviour on a private stack (its own NATS, Postgres and SeaweedFS in a temporary folder, so the
session's shared stack is never disturbed): S3 down → a typed retryable error within seconds; Postgres down →
a typed error; a real crash between the object write and the metadata leaves only a collectable orphan; nothing
half-written is ever served; everything works again once the dependency is back."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
import uuid

import asyncpg
import httpx
import pytest
from ctxbuild_blobclient import BlobClient
from ctxbuild_devstack import Stack
from ctxbuild_platform.errors import RemoteError
from ctxbuild_platform.rpc import RpcClient
from faststream.nats import NatsBroker
from minio import Minio

pytestmark = pytest.mark.integration
BASE_ENV = {"CTX_GC_INTERVAL_S": "0", "CTX_GC_GRACE_S": "1", "CTX_UPLOAD_STALE_S": "1", "CTX_S3_TIMEOUT_S": "1",
            "CTX_DB_TIMEOUT_S": "2"}


def uid() -> str:
    return uuid.uuid4().hex


@pytest.fixture(scope="module")
def private(tmp_path_factory) -> Stack:
    st = Stack(root=tmp_path_factory.mktemp("blobstore-failures"), fast_fsync=True, owner_pid=os.getpid())
    try:
        st.start_infra()
        st.start_service("blobstore", extra_env=BASE_ENV)
        yield st
    finally:
        st.down()


def restart_blobstore(st: Stack, **env: str) -> None:
    st.stop("blobstore")
    st.start_service("blobstore", extra_env={**BASE_ENV, **env})


@pytest.fixture
async def client(private):
    broker = NatsBroker(private.env["CTX_NATS_URL"], logger=None)
    await broker.connect()
    yield BlobClient(RpcClient(broker, default_timeout=8), idle_timeout_s=8)
    await broker.stop()


def minio_of(st: Stack) -> Minio:
    return Minio(st.env["CTX_S3_ENDPOINT"].removeprefix("http://"), access_key=st.env["CTX_S3_ACCESS_KEY"],
                 secret_key=st.env["CTX_S3_SECRET_KEY"], secure=False)


def has_object(st: Stack, sha: str) -> bool:
    return any(True for _ in minio_of(st).list_objects(st.env["CTX_S3_BUCKET"], prefix=f"blobs/{sha}"))


async def row_count(st: Stack, sha: str) -> int:
    conn = await asyncpg.connect(st.env["CTX_DATABASE_URL"])
    try:
        return await conn.fetchval("SELECT count(*) FROM blobstore.blobs WHERE sha256 = $1", sha)
    finally:
        await conn.close()


def readiness(st: Stack) -> httpx.Response:
    return httpx.get(st.env["CTX_BLOBSTORE_HTTP"] + "/readyz", timeout=5)


async def expect_error(coro, dependency: str, codes=("unavailable",)) -> RemoteError:
    """The service's own typed reply naming the dead ``dependency`` — not the client giving up on a service that
    hangs (its request timeout is ``timeout``; its idle watchdog's ``unavailable`` names no dependency)."""
    with pytest.raises(RemoteError) as err:
        await coro
    assert err.value.code in codes, err.value
    assert err.value.remote_message.startswith(f"{dependency}: "), err.value
    return err.value


async def test_s3_down_is_a_quick_retryable_error_and_recovers(private, client):
    conv = uid()
    before = await client.put("written while S3 was up\n" * 10, conv, ("message", uid()), "tool_output")
    private.stop("s3")
    try:
        text = f"{uid()}\n" * 10
        err = await expect_error(client.put(text, conv, ("message", uid()), "tool_output"), "s3")
        assert err.retryable and "s3" in err.remote_message
        big = f"{uid()} big\n" * 60_000  # chunked upload: the bytes travel, the S3 write fails, nothing is kept
        err = await expect_error(client.put(big, conv, ("message", uid()), "tool_output"), "s3")
        assert err.retryable
        # a read needs S3 too: typed, not a result
        err = await expect_error(client.fs_read(conv, before["uri"]), "s3")
        assert err.retryable
        await expect_error(client.get_bytes(conv, sha256=before["sha256"]), "s3")
        r = readiness(private)
        assert r.status_code == 503 and "s3" in r.json()["failing"]
        for t in (text, big):  # nothing half-written: no metadata for what S3 never stored
            assert await row_count(private, hashlib.sha256(t.encode()).hexdigest()) == 0
    finally:
        private.start_s3()  # new ports: the service gets the new endpoint on restart
        restart_blobstore(private)
    assert readiness(private).status_code == 200
    assert await client.get_text(conv, sha256=before["sha256"]) == "written while S3 was up\n" * 10
    again = await client.put(big, conv, ("message", uid()), "tool_output")
    assert again["created"] and await client.get_text(conv, sha256=again["sha256"]) == big


async def test_postgres_down_is_a_typed_error_and_recovers(private, client):
    conv = uid()
    before = await client.put("metadata before the outage\n", conv, ("message", uid()), "tool_output")
    private.stop("postgres")
    try:
        err = await expect_error(client.put(f"{uid()}\n", conv, ("message", uid()), "tool_output"), "postgres")
        assert err.retryable and "postgres" in err.remote_message
        await expect_error(client.fs_read(conv, before["uri"]), "postgres")
        await expect_error(client.read_file(conv, "anything.txt"), "postgres")
        await expect_error(client.get_bytes(conv, sha256=before["sha256"]), "postgres")
        r = readiness(private)
        assert r.status_code == 503 and "postgres" in r.json()["failing"]
    finally:
        private.start_postgres()
        restart_blobstore(private)
    assert (await client.fs_read(conv, before["uri"]))["text"] == "     1\tmetadata before the outage"


async def test_a_crash_between_object_and_metadata_leaves_only_a_collectable_orphan(private, client):
    conv = uid()
    text = f"the crash victim {uid()}\n" * 100
    sha = hashlib.sha256(text.encode()).hexdigest()
    restart_blobstore(private, CTX_FAULT_EXIT_AFTER_OBJECT_WRITE="true")
    try:
        quick = BlobClient(client.rpc, timeout_s=2)
        with pytest.raises(RemoteError) as err:  # the process dies right after the S3 write: no reply comes
            await quick.put(text, conv, ("message", uid()), "tool_output")
        assert err.value.retryable
        for _ in range(50):
            if not private.alive("blobstore"):
                break
            await asyncio.sleep(0.1)
        assert not private.alive("blobstore")
        assert has_object(private, sha) and await row_count(private, sha) == 0
    finally:
        restart_blobstore(private, CTX_GC_INTERVAL_S="0.5")  # the background collector, every half second
    # never served: without its metadata the object does not exist for any reader
    page = await client.fs_read(conv, f"context://vfs/vfs_{sha[:16]}.txt")
    assert (page["kind"], page["code"]) == ("error", "not-found")
    with pytest.raises(RemoteError) as err:
        await client.get_bytes(conv, sha256=sha)
    assert err.value.code == "not-found"
    # older than the grace (1 s) → the background round deletes it
    deadline = time.monotonic() + 10
    while has_object(private, sha) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert not has_object(private, sha)
    # and the same put now succeeds whole
    r = await client.put(text, conv, ("message", uid()), "tool_output")
    assert r["created"] and has_object(private, sha) and await row_count(private, sha) == 1
    assert await client.get_text(conv, sha256=sha) == text
