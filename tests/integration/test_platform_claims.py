"""Claim check on the real NATS server (1 MB max_payload, JetStream Object Store): payloads of any size pass
through a real ``@rpc`` handler and ``claims.publish`` untouched, claims are deleted once read, and a gone or
damaged claim is a typed, retryable error — never ``internal``."""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid

import nats
import pytest
import pytest_asyncio
from ctxbuild_devstack.replica import Replica
from ctxbuild_platform import claims
from ctxbuild_platform.errors import ClaimMissing, RemoteError
from ctxbuild_platform.rpc import RpcClient, rpc, start_servers, stop_servers
from faststream.nats import NatsBroker
from faststream.nats.annotations import NatsMessage
from nats.js.errors import NotFoundError

from tests.support.extra_contracts import with_subject

pytestmark = pytest.mark.integration

SUBJECT = "ctx.test.claims.echo"


@pytest.fixture(scope="module")
def test_contracts(tmp_path_factory):
    """The real contracts plus a subject of our own, loaded for this process only."""
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
              "required": ["data"], "properties": {"data": {"type": "string"}, "sha256": {"type": "string"}},
              "additionalProperties": False}
    yield from with_subject(tmp_path_factory, SUBJECT, schema)


@pytest.fixture
def bucket():
    """A bucket of this test's own, so what is left in it is this test's doing."""
    before = claims.config()
    name = f"CTX_CLAIMS_T{uuid.uuid4().hex[:10]}"
    claims.configure(claims.with_config(bucket=name))
    yield name
    claims.configure(before)


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def server(stack, test_contracts):
    """A real @rpc handler on its own connection: echoes `data` and says what it received (sha256)."""
    broker = NatsBroker(stack.env["CTX_NATS_URL"], logger=None)
    received: list[int] = []

    @rpc(broker, SUBJECT, queue="claims-test")
    async def echo(payload):
        received.append(len(payload["data"]))
        return {"data": payload["data"], "sha256": hashlib.sha256(payload["data"].encode()).hexdigest()}

    await broker.start()
    await start_servers(broker)
    yield received
    await stop_servers(broker, 10.0)
    await broker.stop()


def _text(size: int) -> str:
    """`size` characters that exercise JSON escaping and multi-byte UTF-8, not one repeated byte."""
    unit = 'line "quoted" \\ tab\t é ü 漢字 🙂 ' + uuid.uuid4().hex + "\n"
    return (unit * (size // len(unit) + 1))[:size]


async def _entries(stack, bucket_name: str) -> list:
    """Every object the bucket has seen; a claim read and deleted stays as a deletion marker until its TTL."""
    nc = await nats.connect(stack.env["CTX_NATS_URL"])
    try:
        obs = await nc.jetstream().object_store(bucket_name)
        try:
            return await obs.list()
        except NotFoundError:
            return []
    finally:
        await nc.close()


async def test_5_mb_request_and_reply_pass_untouched_and_leave_no_claim(stack, server, rpc, bucket):
    data = _text(5 * 1024 * 1024)
    reply = await rpc.call(SUBJECT, {"data": data})
    assert reply["data"] == data  # the reply came back by claim as well: byte-identical
    assert reply["sha256"] == hashlib.sha256(data.encode()).hexdigest()  # what the handler saw
    entries = await _entries(stack, bucket)
    assert len(entries) == 2 and all(e.deleted for e in entries)  # request + reply claims, both deleted


async def test_20_mb_payload(server, rpc, bucket):
    data = _text(20 * 1024 * 1024)
    reply = await rpc.call(SUBJECT, {"data": data}, timeout=60)
    assert reply["sha256"] == hashlib.sha256(data.encode()).hexdigest() and reply["data"] == data


async def test_a_tiny_inline_limit_sends_small_payloads_by_claim(stack, server, rpc, bucket):
    claims.configure(claims.with_config(inline_max_bytes=200))
    reply = await rpc.call(SUBJECT, {"data": "x" * 300})
    assert reply["data"] == "x" * 300
    entries = await _entries(stack, bucket)
    assert len(entries) == 2 and all(e.deleted for e in entries)
    # under the limit (request and reply ~100 bytes) nothing is claimed
    await rpc.call(SUBJECT, {"data": "y"})
    assert len(await _entries(stack, bucket)) == 2


async def test_a_gone_request_claim_is_a_typed_retryable_error(server, nats_broker, bucket):
    store = claims.store_for(nats_broker)
    claim = await store.put(claims.encode_json({"data": "gone"}))
    await store.delete(claim)  # consumed by someone else, or expired: the same for the reader
    msg = await nats_broker.request(b"", SUBJECT, timeout=10, headers={claims.CLAIM_HEADER: claim.header()})
    err = json.loads(msg.body)["error"]
    assert err["code"] == "claim-missing" and err["retryable"] is True


async def test_an_expired_claim_is_a_typed_error(server, nats_broker, bucket):
    claims.configure(claims.with_config(max_age_s=1.0))
    store = claims.store_for(nats_broker)
    claim = await store.put(claims.encode_json({"data": "short-lived"}))
    obs = await store.bucket()
    for _ in range(200):  # the server's TTL removes it (no assertion on how long that takes)
        try:
            await obs.get_info(claim.key)
        except NotFoundError:
            break
        await asyncio.sleep(0.1)
    msg = await nats_broker.request(b"", SUBJECT, timeout=10, headers={claims.CLAIM_HEADER: claim.header()})
    err = json.loads(msg.body)["error"]
    assert err["code"] == "claim-missing" and err["retryable"] is True


async def test_a_gone_reply_claim_is_a_typed_error_for_the_caller(nats_broker, bucket):
    store = claims.store_for(nats_broker)
    claim = await store.put(claims.encode_json({"result": {}}))
    await store.delete(claim)
    with pytest.raises(ClaimMissing) as gone:
        await store.open_reply(claims.encode_json(claim.reply_form()))
    assert gone.value.retryable


async def test_a_claim_that_does_not_match_its_bytes_is_refused(server, nats_broker, bucket):
    store = claims.store_for(nats_broker)
    claim = await store.put(claims.encode_json({"data": "original"}))
    forged = claims.Claim(claim.key, claim.size, "0" * 64)
    msg = await nats_broker.request(b"", SUBJECT, timeout=10, headers={claims.CLAIM_HEADER: forged.header()})
    err = json.loads(msg.body)["error"]
    assert err["code"] == "claim-corrupt" and err["retryable"] is True


async def test_no_responders_is_typed_and_its_claim_is_deleted(stack, nats_broker, bucket):
    with pytest.raises(RemoteError) as nobody:
        await RpcClient(nats_broker).call("ctx.test.claims.nobody", {"data": _text(2 * 1024 * 1024)})
    assert nobody.value.code == "unavailable" and nobody.value.retryable
    entries = await _entries(stack, bucket)
    assert len(entries) == 1 and entries[0].deleted


async def test_publish_with_claim_check_reaches_every_subscriber(stack, nats_broker, bucket):
    subject = f"ctx.test.claims.broadcast.{uuid.uuid4().hex[:8]}"
    readers = [NatsBroker(stack.env["CTX_NATS_URL"], logger=None) for _ in range(2)]
    got: list[asyncio.Queue] = [asyncio.Queue() for _ in readers]
    for reader, queue in zip(readers, got, strict=True):
        def on_message(reader=reader, queue=queue):
            async def handle(message: NatsMessage) -> None:
                queue.put_nowait(await claims.message_body(reader, message))
            return handle
        reader.subscriber(subject)(on_message())
        await reader.start()
    try:
        payload = {"text": _text(3 * 1024 * 1024)}
        await claims.publish(nats_broker, subject, payload)
        for queue in got:  # a shared claim: the first reader does not delete it under the second
            assert json.loads(await asyncio.wait_for(queue.get(), 60)) == payload
    finally:
        for reader in readers:
            await reader.stop()


async def test_truncation_subscriber_takes_and_gives_claims(stack, start_service, rpc, bucket):
    """ctx.truncate.step has its own subscriber (not @rpc): a 3 MB step arrives by claim, and with a small inline
    limit on the service its reply goes back by claim too."""
    start_service("blobstore")
    stack.stop("truncation")  # ours must be the only one in the queue group
    replica = await asyncio.to_thread(lambda: Replica(stack, "truncation", "truncation_claims",
                                                      CTX_CLAIMS_BUCKET=bucket,
                                                      CTX_MESSAGE_INLINE_MAX_BYTES="1024").wait_ready())
    try:
        big = "\n".join(f"{i:07d} " + "y" * 80 for i in range(36_000))  # ~3.2 MB
        reply = await rpc.call("ctx.truncate.step", {
            "conversationId": "conv_claims", "turnId": "turn_claims", "settings": {"contextWindow": 16000},
            "parts": [{"type": "tool-result", "toolCallId": "c1", "toolName": "read_file",
                       "output": {"type": "text", "value": big}}]}, timeout=120)
        assert reply["parts"][0]["offload"]["mode"] == "offloaded"
        entries = await _entries(stack, bucket)
        assert len(entries) == 2 and all(e.deleted for e in entries)  # the request's claim and the reply's
    finally:
        await asyncio.to_thread(replica.stop)
