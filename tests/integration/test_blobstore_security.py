"""The allow-list on the real stack: conversation B never reads conversation A's blobs — not by URI, not by full
hash, not by handle prefix, not through a crafted path or file name, not by minting itself a reference — and
malformed requests get typed errors, never a crash and never content."""

import json
import uuid

import pytest
from ctxbuild_blobclient import BlobClient
from ctxbuild_platform.errors import RemoteError

pytestmark = pytest.mark.integration


def uid() -> str:
    return uuid.uuid4().hex


@pytest.fixture(scope="module")
def client(start_service, rpc) -> BlobClient:
    start_service("blobstore")
    return BlobClient(rpc)


@pytest.fixture(scope="module")
async def secret(client):
    """Conversation A's tool output (inline and chunked) and attachment; conversation B is a stranger."""
    a, b = "conv-A-" + uid(), "conv-B-" + uid()
    marker = "SECRET-" + uid()
    small = await client.put(f"{marker} small\n" * 10, a, ("message", uid()), "tool_output")
    large = await client.put(f"{marker} large line\n" * 80_000, a, ("turn", uid()), "provisional")
    att = await client.attach(f"{marker} attachment", a, "report.md", "text/markdown")
    await client.put("B's own output\n", b, ("message", uid()), "tool_output")  # B exists and has blobs
    return {"a": a, "b": b, "marker": marker, "small": small, "large": large, "att": att}


def no_leak(result, marker: str) -> None:
    assert marker not in json.dumps(result, ensure_ascii=False)


async def test_b_cannot_fs_read_a_by_uri(client, secret):
    for blob in (secret["small"], secret["large"], secret["att"]):
        r = await client.fs_read(secret["b"], blob["uri"])
        assert (r["kind"], r["code"]) == ("error", "access-denied")
        no_leak(r, secret["marker"])
        bare = await client.fs_read(secret["b"], blob["uri"].removeprefix("context://vfs/"))  # handle alone
        assert bare["code"] == "access-denied"
    assert (await client.fs_read(secret["a"], secret["small"]["uri"]))["kind"] == "text"


async def test_b_cannot_get_a_by_hash_or_uri(client, secret):
    for blob in (secret["small"], secret["large"]):
        for how in ({"sha256": blob["sha256"]}, {"uri": blob["uri"]}):
            with pytest.raises(RemoteError) as err:
                await client.get_bytes(secret["b"], **how)
            assert err.value.code == "access-denied" and not err.value.retryable
            no_leak(str(err.value), secret["marker"])
            with pytest.raises(RemoteError):
                await client.get_bytes(secret["b"], offset=1, length=5, **how)  # not even a byte range


async def test_b_cannot_use_a_shorter_or_longer_prefix(client, secret):
    sha = secret["small"]["sha256"]
    for uri in (f"context://vfs/vfs_{sha[:15]}.txt", f"context://vfs/vfs_{sha[:8]}.txt",
                f"context://vfs/vfs_{sha[:17]}.txt", f"context://vfs/vfs_{sha}.txt", f"context://vfs/{sha}",
                f"context://vfs/vfs_{sha[:16].upper()}.txt", f"context://vfs/vfs_{sha[:16]}"):
        r = await client.fs_read(secret["b"], uri)
        assert (r["kind"], r["code"]) == ("error", "parse-error"), uri
        no_leak(r, secret["marker"])


@pytest.mark.parametrize("tail", [
    "../vfs_{p}.txt", "vfs_x/../vfs_{p}.txt", "/vfs_{p}.txt", "vfs_{p}.txt/../../etc/passwd", "vfs_{p}.txt?x=1",
    "vfs_{p}.txt#frag", "vfs_%7B{p}%7D.txt", "%2e%2e%2fvfs_{p}.txt", "vfs_{p}%2Etxt", "vfs_{p}.txt%00",
    "vfs_{p}.txt\x00", " vfs_{p}.txt", "vfs_{p}.txt ", "vfs_{p}.txt\n", "..%2F..%2Fvfs_{p}.txt", "%76fs_{p}.txt",
])
async def test_crafted_paths_are_parse_errors(client, secret, tail):
    p = secret["small"]["sha256"][:16]
    for uri in ("context://vfs/" + tail.format(p=p), tail.format(p=p), "/etc/passwd", "file:///etc/passwd",
                "context://vfs/", "s3://ctxbuild-blobs/blobs/" + secret["small"]["sha256"]):
        for conv in (secret["b"], secret["a"]):  # not even the owner gets anything through a crafted path
            r = await client.fs_read(conv, uri)
            assert (r["kind"], r["code"]) == ("error", "parse-error"), uri
            no_leak(r, secret["marker"])


@pytest.mark.parametrize("name", ["report.md", "../conv-A/report.md", "/report.md", "%2e%2e%2freport.md",
                                  "report.md\x00", "./report.md", "REPORT.md", "report.md ", "*", "report.md (1)"])
async def test_b_cannot_read_a_attachment_by_any_name(client, secret, name):
    r = await client.read_file(secret["b"], name)
    assert r["error"]["code"] == "not-found"
    assert r["error"]["message"].endswith("this conversation has no attachments")
    no_leak(r, secret["marker"])


async def test_b_cannot_mint_itself_a_reference(client, rpc, secret):
    sha = secret["large"]["sha256"]
    with pytest.raises(RemoteError) as err:  # ref by hash needs an existing reference in the same conversation
        await client.ref(sha, secret["b"], ("message", uid()), "tool_output")
    assert err.value.code == "access-denied"
    # declaring A's hash in an upload does not skip the transfer for B: B must send the bytes, and other bytes
    # are a digest mismatch — no reference is created
    with pytest.raises(RemoteError) as err:
        await client.put(iter([b"not the secret"]), secret["b"], ("message", uid()), "tool_output", sha256=sha)
    assert err.value.code == "digest-mismatch"
    r = await client.fs_read(secret["b"], secret["large"]["uri"])
    assert r["code"] == "access-denied"


async def test_an_owner_cannot_be_rebound_to_read_another_conversation(client, secret):
    owner = uid()
    await client.put("x", secret["a"], ("message", owner), "tool_output")
    with pytest.raises(RemoteError) as err:
        await client.put("x", secret["b"], ("message", owner), "tool_output")
    assert err.value.code == "owner-conflict"


@pytest.mark.parametrize(("subject", "payload"), [
    ("ctx.blob.upload", {"conversationId": "c", "source": "ctx.persist.append", "owner": {"kind": "turn", "id": "t"},
                         "role": "provisional"}),
    ("ctx.blob.upload", {"conversationId": "c", "source": "_INBOX.>", "owner": {"kind": "turn", "id": "t"},
                         "role": "provisional"}),
    ("ctx.blob.upload", {"conversationId": "c", "source": "_INBOX.x", "owner": {"kind": "turn", "id": "t"},
                         "role": "provisional", "size": -1}),
    ("ctx.blob.upload", {"conversationId": "c", "source": "_INBOX.x", "role": "provisional"}),
    ("ctx.blob.get", {"conversationId": "c", "sink": "_INBOX.x"}),
    ("ctx.blob.ref", {"sha256": "A" * 64, "conversationId": "c", "owner": {"kind": "turn", "id": "t"},
                      "role": "provisional"}),
    ("ctx.blob.ref", {"sha256": "a" * 64, "conversationId": "c", "owner": {"kind": "turn", "id": "t"},
                      "role": "attachment"}),
    ("ctx.blob.release", {"owner": {"kind": "user", "id": "u"}}),
    ("ctx.blob.release", {}),
    ("ctx.blob.gc", {"graceSeconds": 0}),
    ("ctx.blob.fs_read", {"conversationId": "", "uri": "context://vfs/vfs_0000000000000000.txt"}),
    ("ctx.blob.fs_read", {"conversationId": "c", "uri": "context://vfs/vfs_0000000000000000.txt", "limit": 0}),
    ("ctx.blob.read_file", {"conversationId": "c", "filename": "", "offset": 0}),
    ("ctx.blob.read_file", {"conversationId": "c", "filename": "a", "offset": -1}),
    # Postgres text cannot hold NUL: a typed rejection, never a storage error
    ("ctx.blob.fs_read", {"conversationId": "c\x00", "uri": "context://vfs/vfs_0000000000000000.txt"}),
    ("ctx.blob.put", {"content": "x", "conversationId": "c", "owner": {"kind": "turn", "id": "t\x00"},
                      "role": "provisional"}),
    ("ctx.blob.attach", {"conversationId": "c", "displayName": "a\x00.txt", "content": "x", "mediaType": "text/plain"}),
])
async def test_malformed_requests_get_typed_errors(client, rpc, subject, payload):
    with pytest.raises(RemoteError) as err:
        await rpc.call(subject, payload)
    assert err.value.code == "invalid-payload" and err.value.retryable is False


@pytest.mark.parametrize("body", [b"not json", b"[1,2]", b'{"conversationId": 5}', b"\xff\xfe", b""])
async def test_garbage_bytes_get_typed_errors(client, nats_broker, body):
    for subject in ("ctx.blob.upload", "ctx.blob.get", "ctx.blob.release", "ctx.blob.fs_read"):
        msg = await nats_broker.request(body, subject, timeout=10)
        assert json.loads(msg.body)["error"]["code"] == "invalid-payload"
