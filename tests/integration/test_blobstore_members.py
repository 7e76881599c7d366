"""A fold transcript's members on the real stack (SPEC §6, §15.2): the archived outputs of the rows a fold folded
stay readable while the transcript is in the read's retained context — and only then, only for its own
conversation, only for what its put declared."""

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


async def _read(rpc, conv: str, uri: str, persisted: list[str], turn: str | None = None) -> dict:
    req = {"conversationId": conv, "uri": uri, "retained": {"fileAttachments": [], "persistedUris": persisted}}
    if turn:
        req["turnId"] = turn
    return await rpc.call("ctx.blob.fs_read", req)


@pytest.fixture(scope="module")
async def fold(client):
    """Two folded outputs of conversation A, a third one not folded, and the fold's transcript naming the first
    two as members (inline put), plus a large transcript through the chunked upload."""
    conv = "conv-members-" + uid()
    marker = uid()
    folded = [await client.put(f"{marker} folded output {i}\n" * 50, conv, ("message", uid()), "tool_output")
              for i in range(2)]
    other = await client.put(f"{marker} not folded\n", conv, ("message", uid()), "tool_output")
    members = [f["uri"] for f in folded]
    transcript = await client.put(f"transcript {marker}\n", conv, ("turn", uid()), "tool_output",
                                  media_type="text/plain", members=members)
    big = await client.put(f"big transcript {marker}\n" * 60_000, conv, ("turn", uid()), "tool_output",
                           members=members[:1])
    return {"conv": conv, "marker": marker, "folded": folded, "other": other, "transcript": transcript,
            "big": big}


async def test_a_member_is_readable_with_only_its_transcript_retained(rpc, fold):
    for i, f in enumerate(fold["folded"]):
        page = await _read(rpc, fold["conv"], f["uri"], [fold["transcript"]["uri"]])
        assert page["kind"] == "text", page
        assert f"{fold['marker']} folded output {i}" in page["text"]


async def test_a_non_member_stays_unreadable(rpc, fold):
    page = await _read(rpc, fold["conv"], fold["other"]["uri"], [fold["transcript"]["uri"]])
    assert page["code"] == "not-found"
    assert fold["marker"] not in str(page)


async def test_without_the_transcript_retained_a_member_is_not_readable(rpc, fold):
    uri = fold["folded"][0]["uri"]
    assert (await _read(rpc, fold["conv"], uri, []))["code"] == "not-found"
    assert (await _read(rpc, fold["conv"], uri, [fold["other"]["uri"]]))["code"] == "not-found"
    # a conversation-wide read (no retained) is unchanged
    wide = await rpc.call("ctx.blob.fs_read", {"conversationId": fold["conv"], "uri": uri})
    assert wide["kind"] == "text"


async def test_the_chunked_upload_records_members_too(rpc, fold):
    ok = await _read(rpc, fold["conv"], fold["folded"][0]["uri"], [fold["big"]["uri"]])
    assert ok["kind"] == "text", ok
    no = await _read(rpc, fold["conv"], fold["folded"][1]["uri"], [fold["big"]["uri"]])
    assert no["code"] == "not-found"


async def test_membership_is_per_conversation(client, rpc, fold):
    """Another conversation holding the same bytes and naming the transcript's URI reads nothing through it."""
    b = "conv-members-B-" + uid()
    await client.put(f"transcript {fold['marker']}\n", b, ("turn", uid()), "tool_output")  # same transcript bytes
    page = await _read(rpc, b, fold["folded"][0]["uri"], [fold["transcript"]["uri"]])
    assert page["code"] == "not-found"
    assert fold["marker"] not in str(page)


async def test_a_repeated_put_is_idempotent_and_members_must_be_uris(client, rpc, fold):
    again = await client.put(f"transcript {fold['marker']}\n", fold["conv"], ("turn", uid()), "tool_output",
                             members=[f["uri"] for f in fold["folded"]])
    assert again["sha256"] == fold["transcript"]["sha256"]
    page = await _read(rpc, fold["conv"], fold["folded"][1]["uri"], [fold["transcript"]["uri"]])
    assert page["kind"] == "text", page
    with pytest.raises(RemoteError) as err:
        await client.put("x", fold["conv"], ("turn", uid()), "tool_output", members=["../etc/passwd"])
    assert err.value.code == "invalid-payload"
