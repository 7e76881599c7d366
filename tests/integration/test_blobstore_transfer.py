"""Large payloads through the blob store on the real stack: the claim check (chunked upload pulled from the
caller's inbox, read-back pushed to it), dedup under concurrency, references, typed errors — and a 100 MB tool
output in and out with the service's memory bounded."""

import asyncio
import contextlib
import hashlib
import json
import threading
import time
import uuid

import psutil
import pytest
from ctxbuild_blobclient import BlobClient
from ctxbuild_platform.errors import RemoteError
from minio import Minio

pytestmark = pytest.mark.integration
MIB = 1024 * 1024


def uid() -> str:
    return uuid.uuid4().hex


@pytest.fixture(scope="module")
def blobstore(start_service) -> str:
    return start_service("blobstore")


@pytest.fixture(scope="module")
def client(blobstore, rpc) -> BlobClient:
    return BlobClient(rpc)


def objects(minio: Minio, bucket: str, prefix: str) -> list[str]:
    return [o.object_name for o in minio.list_objects(bucket, prefix=prefix, recursive=True)]


def astral_text(n_lines: int, tag: str) -> str:
    # multi-byte and astral characters everywhere, so 512 KiB chunk borders fall inside characters
    return "".join(f"{tag} {i:06d} é😀𝄞 naïve\n" for i in range(n_lines))


async def test_upload_and_read_back_across_chunk_borders(client, minio, stack, pg):
    conv = uid()
    text = astral_text(60_000, uid()[:6])  # ~1.9 MB: too big for one NATS message
    data = text.encode()
    assert len(data) > MIB + 512 * 1024
    r = await client.put(text, conv, ("turn", uid()), "provisional")
    sha = hashlib.sha256(data).hexdigest()
    assert (r["sha256"], r["size"], r["created"], r["transferred"]) == (sha, len(data), True, len(data))
    assert (r["isText"], r["chars"], r["lines"]) == (True, len(text), 60_000)
    assert r["uri"] == f"context://vfs/vfs_{sha[:16]}.txt"
    # the object holds exactly the bytes; metadata and the seek index are in Postgres
    assert objects(minio, stack.env["CTX_S3_BUCKET"], f"blobs/{sha}") == [f"blobs/{sha}"]
    row = await pg.fetchrow("SELECT size, chars, lines, is_text FROM blobstore.blobs WHERE sha256 = $1", sha)
    assert tuple(row) == (len(data), len(text), 60_000, True)
    assert await pg.fetchval("SELECT cardinality(line_nos) FROM blobstore.blob_index WHERE sha256 = $1", sha) > 10

    assert await client.get_text(conv, sha256=sha) == text
    assert await client.get_text(conv, uri=r["uri"]) == text
    assert "".join([t async for t in client.iter_text(conv, sha256=sha)]) == text
    # a byte range, starting and ending inside characters: exactly those bytes
    part = await client.get_bytes(conv, sha256=sha, offset=MIB - 1, length=MIB + 3)
    assert part == data[MIB - 1: 2 * MIB + 2]
    assert await client.get_bytes(conv, sha256=sha, offset=len(data)) == b""

    # fs_read pages from the middle and the end come from the seek index, identical to whole-text paging
    lines = text.split("\n")
    page = await client.fs_read(conv, r["uri"], offset=33_333, limit=3)
    assert page["text"] == "\n".join(f"{n:>6}\t{lines[n - 1]}" for n in range(33_333, 33_336))
    last = await client.fs_read(conv, r["uri"], offset=59_999, limit=10)
    assert (last["startLine"], last["endLine"], last["modelText"] == last["text"]) == (59_999, 60_000, True)


async def test_iterator_upload_without_declared_hash_goes_through_staging(client, minio, stack):
    conv, tag = uid(), uid()[:8]

    def produce():
        for i in range(12):  # 12 × ~1.1 MB, more than one 8 MiB S3 part
            yield "".join(f"{tag}-{i:02d}-{j:05d} {'w' * 90}\n" for j in range(10_000))

    expected = "".join(produce())
    r = await client.put(produce(), conv, ("message", uid()), "tool_output")
    assert r["sha256"] == hashlib.sha256(expected.encode()).hexdigest() and r["created"]
    assert await client.get_text(conv, sha256=r["sha256"]) == expected
    # the staging object is gone, nothing is left half-uploaded
    bucket = stack.env["CTX_S3_BUCKET"]
    assert not list(objects(minio, bucket, "uploads/"))
    assert not list(minio._list_multipart_uploads(bucket, prefix="blobs/" + r["sha256"]).uploads)


async def test_twenty_concurrent_puts_of_one_content_make_one_object(client, minio, stack, pg):
    for content in (f"small {uid()}\n" * 100, astral_text(40_000, uid()[:6])):  # inline path and upload path
        conv = uid()
        owners = [uid() for _ in range(20)]
        replies = await asyncio.gather(*(client.put(content, conv, ("message", o), "tool_output") for o in owners))
        sha = hashlib.sha256(content.encode()).hexdigest()
        assert {r["sha256"] for r in replies} == {sha}
        assert sum(r["created"] for r in replies) == 1
        assert objects(minio, stack.env["CTX_S3_BUCKET"], f"blobs/{sha}") == [f"blobs/{sha}"]
        assert await pg.fetchval("SELECT count(*) FROM blobstore.blobs WHERE sha256 = $1", sha) == 1
        assert await pg.fetchval("SELECT count(*) FROM blobstore.refs WHERE sha256 = $1", sha) == 20


async def test_declared_hash_skips_the_transfer_only_for_the_same_conversation(client, pg):
    conv, other = uid(), uid()
    text = astral_text(200_000, uid()[:6])  # ~7.7 MB: the client hashes it first
    first = await client.put(text, conv, ("turn", uid()), "provisional")
    assert first["transferred"] == len(text.encode()) and first["created"]
    # the persist lane storing the same text for a message of the same conversation: no byte travels
    again = await client.put(text, conv, ("message", uid()), "tool_output")
    assert (again["transferred"], again["created"], again["sha256"]) == (0, False, first["sha256"])
    # another conversation must prove it has the content: the bytes travel, nothing is stored twice
    other_put = await client.put(text, other, ("message", uid()), "tool_output")
    assert other_put["transferred"] == len(text.encode()) and not other_put["created"]
    assert await pg.fetchval("SELECT count(DISTINCT conversation_id) FROM blobstore.refs WHERE sha256 = $1",
                             first["sha256"]) == 2


async def test_a_wrong_declared_hash_stores_nothing(client, rpc, minio, stack, pg):
    conv = uid()
    text = f"{uid()}\n" * 200_000
    fake = hashlib.sha256(b"something else " + uid().encode()).hexdigest()
    with pytest.raises(RemoteError) as err:
        await client.put(text, conv, ("turn", uid()), "provisional", sha256=fake)
    assert err.value.code == "digest-mismatch" and not err.value.retryable
    real = hashlib.sha256(text.encode()).hexdigest()
    for sha in (fake, real):
        assert await pg.fetchval("SELECT count(*) FROM blobstore.blobs WHERE sha256 = $1", sha) == 0
        assert objects(minio, stack.env["CTX_S3_BUCKET"], f"blobs/{sha}") == []
    assert not minio._list_multipart_uploads(stack.env["CTX_S3_BUCKET"], prefix=f"blobs/{fake}").uploads
    with pytest.raises(RemoteError) as err:  # declared size wrong
        await client.put(iter([b"abc"]), conv, ("turn", uid()), "provisional", size=4)
    assert err.value.code == "digest-mismatch"


async def test_large_attachment_gets_a_unique_handle_and_pages_by_chars(client):
    conv = uid()
    text = astral_text(50_000, "att")
    a1 = await client.attach(text, conv, "big.log")
    a2 = await client.attach(text + "more", conv, "big.log")
    assert (a1["handle"], a2["handle"]) == ("big.log", "big.log (2)")
    assert a1["size"] == len(text.encode()) and a1["mediaType"] == "text/plain"
    offset = len(text) - 1500  # far past the first MB: served through the char marks
    r = await client.read_file(conv, "big.log", offset=offset, limit=1000)
    assert r["text"] == text[offset: offset + 1000] and r["nextOffset"] == offset + 1000
    assert r["totalChars"] == len(text)
    tail = await client.read_file(conv, "big.log", offset=r["nextOffset"], limit=200_000)
    assert tail["text"] == text[offset + 1000:] and "nextOffset" not in tail


async def test_binary_content_is_stored_but_not_served_as_text(client):
    conv = uid()
    data = bytes(range(256)) * 5000
    r = await client.put(iter([data]), conv, ("message", uid()), "tool_output", media_type="application/octet-stream")
    assert r["isText"] is False and "chars" not in r
    assert await client.get_bytes(conv, sha256=r["sha256"]) == data
    page = await client.fs_read(conv, r["uri"])
    assert (page["kind"], page["code"]) == ("error", "binary")
    att = await client.attach(data, conv, "blob.bin", "application/octet-stream")
    assert (await client.read_file(conv, att["handle"]))["error"]["code"] == "binary"


async def test_ref_and_release(client, pg):
    conv, turn, msg = uid(), uid(), uid()
    r = await client.put(astral_text(100, uid()), conv, ("turn", turn), "provisional")
    sha = r["sha256"]
    ref = await client.ref(sha, conv, ("message", msg), "tool_output")
    assert ref["sha256"] == sha and ref["created"] is False
    assert await client.release(("turn", turn), role="provisional") == 1
    assert await pg.fetchval("SELECT unreferenced_since FROM blobstore.blobs WHERE sha256 = $1", sha) is None
    assert (await client.fs_read(conv, r["uri"]))["kind"] == "text"  # the message still references it
    assert await client.release(("message", msg)) == 1
    assert await pg.fetchval("SELECT unreferenced_since FROM blobstore.blobs WHERE sha256 = $1", sha) is not None
    assert (await client.fs_read(conv, r["uri"]))["code"] == "access-denied"  # no reference, no read
    assert await client.release(("message", msg)) == 0  # idempotent
    with pytest.raises(RemoteError) as err:  # ref needs the conversation to hold a reference already
        await client.ref(sha, conv, ("message", uid()), "tool_output")
    assert err.value.code == "access-denied"
    with pytest.raises(RemoteError) as err:
        await client.ref("0" * 64, conv, ("message", uid()), "tool_output")
    assert err.value.code == "not-found"


async def test_release_of_an_attachment_removes_its_handle(client):
    conv = uid()
    att = await client.attach("attached text", conv, "notes.txt")
    assert (await client.read_file(conv, "notes.txt"))["text"] == "attached text"
    assert await client.release(("conversation", conv), role="attachment", sha256=att["sha256"]) == 1
    assert (await client.read_file(conv, "notes.txt"))["error"]["code"] == "not-found"


async def test_get_typed_errors(client, rpc, nats_broker):
    conv = uid()
    r = await client.put("some text\n" * 10, conv, ("turn", uid()), "provisional")
    with pytest.raises(RemoteError) as err:
        await client.get_bytes(conv, sha256="0" * 64)
    assert err.value.code == "not-found"
    with pytest.raises(RemoteError) as err:
        await client.get_bytes(conv, sha256=r["sha256"], offset=10_000)
    assert err.value.code == "invalid-payload"
    with pytest.raises(RemoteError) as err:
        await client.get_bytes(conv, uri="context://vfs/../etc/passwd")
    assert err.value.code == "invalid-payload"
    sink = nats_broker.connection.new_inbox()
    for bad in ({"conversationId": conv, "sink": "ctx.persist.append", "sha256": r["sha256"]},  # not an inbox
                {"conversationId": conv, "sink": sink + "\n", "sha256": r["sha256"]},
                {"conversationId": conv, "sink": sink, "sha256": r["sha256"], "uri": r["uri"]},
                {"conversationId": conv, "sink": sink, "sha256": r["sha256"], "length": -1}):
        with pytest.raises(RemoteError) as err:
            await rpc.call("ctx.blob.get", bad)
        assert err.value.code == "invalid-payload" and not err.value.retryable
    # nobody listening on the sink: the service gives up quickly and says so
    with pytest.raises(RemoteError) as err:
        await rpc.call("ctx.blob.get", {"conversationId": conv, "sink": sink, "sha256": r["sha256"]})
    assert err.value.code == "transfer-aborted" and err.value.retryable


async def test_upload_from_a_source_that_fails_or_vanishes(client, rpc, minio, stack):
    conv = uid()

    def failing():
        yield "x" * MIB
        raise RuntimeError("the tool crashed mid-output")

    with pytest.raises(RuntimeError, match="crashed mid-output"):
        await client.put(failing(), conv, ("turn", uid()), "provisional")
    with pytest.raises(RemoteError) as err:  # an inbox nobody serves
        await rpc.call("ctx.blob.upload", {"conversationId": conv, "source": "_INBOX.nobody" + uid(),
                                           "owner": {"kind": "turn", "id": uid()}, "role": "provisional"})
    assert err.value.code == "transfer-aborted" and err.value.retryable
    assert objects(minio, stack.env["CTX_S3_BUCKET"], "uploads/") == []


def gen_100mb(hasher) -> tuple:
    """~100 MB of numbered log lines, generated chunk by chunk (never whole in the test's memory)."""
    state = {"lines": 0, "bytes": 0}

    def chunks():
        i = 0
        while state["bytes"] < 100_000_000:
            piece = "".join(f"{n:08d} tool output line with some payload {'ab' * 20} ✓\n" for n in range(i, i + 20_000))
            i += 20_000
            b = piece.encode()
            hasher.update(b)
            state["lines"] += 20_000
            state["bytes"] += len(b)
            yield piece

    return chunks, state


async def test_100_mb_round_trip_with_bounded_service_memory(client, stack):
    proc = psutil.Process(stack.procs["blobstore"]["pid"])
    peak = {"rss": proc.memory_info().rss}
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            with contextlib.suppress(psutil.Error):
                peak["rss"] = max(peak["rss"], proc.memory_info().rss)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        conv = uid()
        hasher = hashlib.sha256()
        chunks, state = gen_100mb(hasher)
        t0 = time.monotonic()
        r = await client.put(chunks(), conv, ("message", uid()), "tool_output")
        upload_s = time.monotonic() - t0
        sha = hasher.hexdigest()
        assert (r["sha256"], r["size"], r["lines"]) == (sha, state["bytes"], state["lines"])
        assert r["size"] > 100_000_000

        back = hashlib.sha256()
        n = 0
        t0 = time.monotonic()
        async for c in client.iter_chunks(conv, sha256=sha):
            assert len(c) <= 512 * 1024
            back.update(c)
            n += len(c)
        readback_s = time.monotonic() - t0
        assert (n, back.hexdigest()) == (state["bytes"], sha)

        total = state["lines"]
        for offset in (1, total // 2 + 7, total - 1999):
            page = await client.fs_read(conv, r["uri"], offset=offset, limit=500)
            assert page["kind"] == "text" and page["startLine"] == offset and page["totalLines"] == total
            first = page["text"].split("\n")[0]
            assert first == f"{offset:>6}\t{offset - 1:08d} tool output line with some payload {'ab' * 20} ✓"
    finally:
        stop.set()
        sampler.join()
    print(json.dumps({"upload_s": round(upload_s, 2), "readback_s": round(readback_s, 2),
                      "service_peak_rss_mb": round(peak["rss"] / MIB, 1)}))
    assert peak["rss"] < 300 * MIB, f"blob store peaked at {peak['rss'] / MIB:.0f} MB for a 100 MB blob"
