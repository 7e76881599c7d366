"""Blob store service on the real stack (NATS, Postgres, SeaweedFS S3): the process is started exactly as in
production (`python -m ctxbuild_blobstore`) and driven over NATS; S3 and Postgres are inspected directly."""

import asyncio
import json
import uuid

import httpx
import pytest
from ctxbuild_blobstore.adapters.migrate import apply_migrations
from ctxbuild_codec.trim import sha256_hex, vfs_uri
from ctxbuild_platform.errors import RemoteError

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def blobstore(start_service) -> str:
    return start_service("blobstore")


def uid() -> str:
    return uuid.uuid4().hex


def put_req(content: str, conv: str, owner_id: str, kind: str = "message", role: str = "tool_output") -> dict:
    return {"content": content, "conversationId": conv, "owner": {"kind": kind, "id": owner_id}, "role": role}


def test_readiness_reports_ready(blobstore):
    r = httpx.get(f"{blobstore}/readyz", timeout=5)
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "ready"}


async def test_migrations_are_tracked_in_the_service_schema(blobstore, pg):
    applied = await pg.fetch("SELECT migration_id FROM blobstore._yoyo_migration ORDER BY migration_id")
    assert [r["migration_id"] for r in applied] == ["0001_blobstore_initial", "0002_blobstore_index_gc",
                                                       "0003_blobstore_members"]
    assert await pg.fetchval("SELECT to_regclass('public._yoyo_migration')") is None  # no clash with others


async def test_migrations_rerun_as_a_no_op(blobstore, stack):
    # what every restart and every extra replica does
    assert await apply_migrations(stack.env["CTX_DATABASE_URL"]) == []


async def test_put_stores_object_then_metadata_and_dedups_concurrent_puts(blobstore, rpc, minio, stack, pg):
    conv, m1, m2 = uid(), uid(), uid()
    content = f"résumé ✓ {uid()}\n" * 40  # multi-byte: size counts UTF-8 bytes
    sha = sha256_hex(content)

    r1, r2 = await asyncio.gather(rpc.call("ctx.blob.put", put_req(content, conv, m1)),
                                  rpc.call("ctx.blob.put", put_req(content, conv, m2)))
    for r in (r1, r2):
        assert r["sha256"] == sha
        assert r["uri"] == vfs_uri(sha) == f"context://vfs/vfs_{sha[:16]}.txt"
        assert r["handle"] == f"vfs_{sha[:16]}.txt"
        assert r["size"] == len(content.encode()) > len(content)
    assert sorted([r1["created"], r2["created"]]) == [False, True]  # exactly one call stored it

    # one object in S3, holding exactly the bytes
    bucket = stack.env["CTX_S3_BUCKET"]
    objs = list(minio.list_objects(bucket, prefix=f"blobs/{sha}"))
    assert [o.object_name for o in objs] == [f"blobs/{sha}"]
    resp = minio.get_object(bucket, f"blobs/{sha}")
    try:
        assert resp.read() == content.encode()
    finally:
        resp.close()
        resp.release_conn()

    # one metadata row, two references
    row = await pg.fetchrow("SELECT size, chars, prefix FROM blobstore.blobs WHERE sha256 = $1", sha)
    assert dict(row) == {"size": len(content.encode()), "chars": len(content), "prefix": sha[:16]}
    refs = await pg.fetch("SELECT owner_kind, owner_id, role, conversation_id FROM blobstore.refs "
                          "WHERE sha256 = $1 ORDER BY owner_id", sha)
    assert [tuple(r) for r in refs] == sorted([("message", m1, "tool_output", conv),
                                               ("message", m2, "tool_output", conv)], key=lambda t: t[1])

    # the same reference again is idempotent
    again = await rpc.call("ctx.blob.put", put_req(content, conv, m1))
    assert again["created"] is False
    assert await pg.fetchval("SELECT count(*) FROM blobstore.refs WHERE sha256 = $1", sha) == 2


async def test_owner_cannot_be_rebound_to_another_conversation(blobstore, rpc):
    content, owner = f"x {uid()}", uid()
    await rpc.call("ctx.blob.put", put_req(content, uid(), owner))
    with pytest.raises(RemoteError) as err:
        await rpc.call("ctx.blob.put", put_req(content, uid(), owner))
    assert err.value.code == "owner-conflict" and not err.value.retryable


async def test_fs_read_pages_through_a_blob(blobstore, rpc):
    conv = uid()
    content = "".join(f"line {i} {uid()[:4]}\n" for i in range(1, 5001))
    lines = content.split("\n")[:-1]
    put = await rpc.call("ctx.blob.put", put_req(content, conv, uid(), kind="turn", role="provisional"))

    first = await rpc.call("ctx.blob.fs_read", {"conversationId": conv, "uri": put["uri"]})
    assert (first["kind"], first["startLine"], first["endLine"], first["totalLines"]) == ("text", 1, 2000, 5000)
    assert first["text"].split("\n")[0] == f"     1\t{lines[0]}"
    assert first["text"].split("\n")[-1] == f"  2000\t{lines[1999]}"
    assert first["modelText"] == (first["text"] + "\n\n[showing lines 1-2000 of 5000; 3000 more — "
                                                  "call again with offset=2001 to continue]")

    last = await rpc.call("ctx.blob.fs_read", {"conversationId": conv, "uri": put["uri"], "offset": 4001,
                                               "limit": 2000, "turnId": uid()})
    assert (last["startLine"], last["endLine"]) == (4001, 5000)
    assert last["modelText"] == last["text"]  # nothing remains: no hint
    assert last["text"].split("\n")[-1] == f"  5000\t{lines[4999]}"

    past = await rpc.call("ctx.blob.fs_read", {"conversationId": conv, "uri": put["uri"], "offset": 5001})
    assert past["kind"] == "error" and past["code"] == "offset-out-of-range"
    assert past["modelText"].startswith("[Error: offset-out-of-range] ")


async def test_fs_read_page_over_the_cap_suggests_a_limit(blobstore, rpc):
    conv = uid()
    content = "".join(f"{i:05d}" + "z" * 95 + "\n" for i in range(2000))  # 100-char lines
    put = await rpc.call("ctx.blob.put", put_req(content, conv, uid()))
    r = await rpc.call("ctx.blob.fs_read", {"conversationId": conv, "uri": put["uri"]})
    # rendered page: 2000 * (6 + 1 + 100) + 1999 = 215999 chars; floor(49800 / (215999 / 2000)) = 461
    assert r == {"kind": "error", "code": "output-too-large",
                 "message": "lines 1-2000 render to 215999 chars, over the 50000-char read cap; call again with "
                            "limit=461",
                 "modelText": "[Error: output-too-large] lines 1-2000 render to 215999 chars, over the "
                              "50000-char read cap; call again with limit=461"}
    ok = await rpc.call("ctx.blob.fs_read", {"conversationId": conv, "uri": put["uri"], "limit": 461})
    assert ok["kind"] == "text" and ok["endLine"] == 461


async def test_fs_read_is_denied_to_another_conversation(blobstore, rpc):
    owner_conv, other_conv = uid(), uid()
    secret = f"secret tool output {uid()}"
    put = await rpc.call("ctx.blob.put", put_req(secret, owner_conv, uid()))
    r = await rpc.call("ctx.blob.fs_read", {"conversationId": other_conv, "uri": put["uri"]})
    assert r["kind"] == "error" and r["code"] == "access-denied"
    assert secret not in json.dumps(r)
    ok = await rpc.call("ctx.blob.fs_read", {"conversationId": owner_conv, "uri": put["uri"]})
    assert ok["text"] == f"     1\t{secret}"


async def test_fs_read_unknown_and_malformed_uris(blobstore, rpc):
    conv = uid()
    r = await rpc.call("ctx.blob.fs_read", {"conversationId": conv, "uri": "context://vfs/vfs_00000000deadbeef.txt"})
    assert (r["kind"], r["code"]) == ("error", "not-found")
    bad = await rpc.call("ctx.blob.fs_read", {"conversationId": conv, "uri": "context://vfs/../../etc/passwd"})
    assert (bad["kind"], bad["code"]) == ("error", "parse-error")
    assert bad["modelText"].startswith("[Error: parse-error] not a stored-output URI")


async def test_fs_read_refuses_a_colliding_prefix(blobstore, rpc, pg):
    conv = uid()
    content = f"the real content {uid()}"
    put = await rpc.call("ctx.blob.put", put_req(content, conv, uid()))
    sha = put["sha256"]
    assert (await rpc.call("ctx.blob.fs_read", {"conversationId": conv, "uri": put["uri"]}))["kind"] == "text"

    # a second blob whose full hash differs but whose 16-hex handle is the same
    crafted = sha[:16] + ("f" * 48 if sha[16:] != "f" * 48 else "e" * 48)
    await pg.execute("INSERT INTO blobstore.blobs (sha256, size, chars) VALUES ($1, 1, 1)", crafted)
    try:
        r = await rpc.call("ctx.blob.fs_read", {"conversationId": conv, "uri": put["uri"]})
        assert r["kind"] == "error" and r["code"] == "ambiguous-handle"
        assert content not in json.dumps(r)
    finally:
        await pg.execute("DELETE FROM blobstore.blobs WHERE sha256 = $1", crafted)


async def test_attach_gives_duplicate_names_numbered_handles(blobstore, rpc, pg):
    conv = uid()

    def attach(content: str, conv_id: str = conv) -> dict:
        return {"conversationId": conv_id, "displayName": "report.md", "content": content,
                "mediaType": "text/markdown"}

    first = await rpc.call("ctx.blob.attach", attach("v1"))
    assert first["handle"] == "report.md" and first["displayName"] == "report.md"
    assert first["mediaType"] == "text/markdown" and first["size"] == 2 and first["sha256"] == sha256_hex("v1")
    # concurrent uploads of the same name still get distinct handles (one is identical content: dedup)
    more = await asyncio.gather(*(rpc.call("ctx.blob.attach", attach(c)) for c in ("v2", "v1", "v3")))
    assert sorted(r["handle"] for r in more) == ["report.md (2)", "report.md (3)", "report.md (4)"]
    # another conversation has its own namespace
    assert (await rpc.call("ctx.blob.attach", attach("v9", uid())))["handle"] == "report.md"

    rows = await pg.fetch("SELECT handle, sha256 FROM blobstore.attachments WHERE conversation_id = $1", conv)
    assert len(rows) == 4
    refs = await pg.fetch("SELECT owner_kind, owner_id, role FROM blobstore.refs WHERE conversation_id = $1", conv)
    assert {tuple(r) for r in refs} == {("conversation", conv, "attachment")}
    assert len(refs) == 3  # v1, v2, v3: one reference per distinct blob


async def test_read_file_pages_an_attachment(blobstore, rpc):
    conv = uid()
    content = "".join(f"{i}:😀é\n" for i in range(3000))  # astral characters throughout
    att = await rpc.call("ctx.blob.attach", {"conversationId": conv, "displayName": "data.txt", "content": content,
                                             "mediaType": "text/plain"})
    first = await rpc.call("ctx.blob.read_file", {"conversationId": conv, "filename": att["handle"]})
    assert first["text"] == content[:8000] and first["totalChars"] == len(content) and first["nextOffset"] == 8000
    assert first["modelText"] == (content[:8000] + f"\n\n[Showing 8000 of {len(content)} chars. "
                                                   "Call read_file again with offset=8000 for more.]")
    got, offset = [], 0
    while True:
        r = await rpc.call("ctx.blob.read_file", {"conversationId": conv, "filename": "data.txt", "offset": offset,
                                                  "limit": 7777})
        got.append(r["text"])
        if "nextOffset" not in r:
            assert r["modelText"] == r["text"]
            break
        offset = r["nextOffset"]
    assert "".join(got) == content

    missing = await rpc.call("ctx.blob.read_file", {"conversationId": conv, "filename": "nope.txt"})
    assert missing == {"error": {"code": "not-found",
                                 "message": "no attached file named 'nope.txt'; attached files: data.txt"},
                       "modelText": "[Error: not-found] no attached file named 'nope.txt'; attached files: data.txt"}
    other = await rpc.call("ctx.blob.read_file", {"conversationId": uid(), "filename": "data.txt"})
    assert other["error"]["code"] == "not-found"  # another conversation's attachment does not exist for it


@pytest.mark.parametrize(("subject", "payload"), [
    ("ctx.blob.put", {"content": "x"}),
    ("ctx.blob.put", {"content": "x", "conversationId": "c", "owner": {"kind": "user", "id": "u"},
                      "role": "tool_output"}),
    ("ctx.blob.fs_read", {"conversationId": "c", "uri": "context://vfs/vfs_0000000000000000.txt", "offset": 0}),
    ("ctx.blob.read_file", {"conversationId": "c", "filename": "a", "limit": 200_001}),
    ("ctx.blob.attach", {"conversationId": "c", "displayName": "", "content": "x", "mediaType": "text/plain"}),
])
async def test_bad_payloads_get_invalid_payload_replies(blobstore, rpc, subject, payload):
    with pytest.raises(RemoteError) as err:
        await rpc.call(subject, payload)
    assert err.value.code == "invalid-payload" and err.value.retryable is False


async def test_lone_surrogate_content_is_rejected_not_crashed(blobstore, nats_broker):
    # valid JSON, but "\ud800" has no UTF-8 form, so it has no content address
    body = b'{"content":"a\\ud800b","conversationId":"c","owner":{"kind":"turn","id":"t"},"role":"provisional"}'
    msg = await nats_broker.request(body, "ctx.blob.put", timeout=10)
    reply = json.loads(msg.body)
    assert reply["error"]["code"] == "invalid-payload"
