"""``@rpc`` hands each request to its handler without a thread hop: the message parameter (``OnLoop``, a public
fast_depends ``CustomField`` around ``faststream.Context("message")``) is resolved on the event loop. Pinned here
through FastStream's in-memory test broker: if FastStream or fast_depends change how a custom field is resolved,
this fails (the reply still comes, but through a worker thread)."""

from __future__ import annotations

import json

import anyio.to_thread
import pytest
from ctxbuild_codec.models.subjects.ctx_persist_read_stream_reply import PersistReadStreamReply
from ctxbuild_codec.models.subjects.ctx_persist_read_stream_request import PersistReadStreamRequest
from ctxbuild_platform import claims, contracts
from ctxbuild_platform.rpc import rpc
from faststream.nats import NatsBroker, TestNatsBroker

SUBJECT = "ctx.persist.read_stream"


@pytest.fixture(autouse=True)
def real_contracts():
    contracts.reset_cache()
    yield
    contracts.reset_cache()


async def test_a_request_reaches_its_handler_without_a_worker_thread(monkeypatch):
    hops = []
    run_sync = anyio.to_thread.run_sync

    async def counted(func, *args, **kwargs):
        hops.append(getattr(func, "__qualname__", repr(func)))
        return await run_sync(func, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counted)
    # the in-memory broker's connection has no max_payload: every reply here is small enough to go inline
    monkeypatch.setattr(claims.ClaimStore, "inline_limit", lambda self: 1 << 20)
    broker = NatsBroker(logger=None)

    @rpc(broker, SUBJECT, queue="persistence")
    async def read_stream(req: PersistReadStreamRequest) -> PersistReadStreamReply:
        return PersistReadStreamReply(streamId=req.streamId, events=[], lastVersion=0, nextVersion=1, more=False)

    async with TestNatsBroker(broker) as br:
        reply = await br.request(json.dumps({"streamId": "turn:t1"}).encode(), SUBJECT, timeout=5)
    assert json.loads(reply.body) == {
        "result": {"streamId": "turn:t1", "events": [], "lastVersion": 0, "nextVersion": 1, "more": False}}
    assert hops == []
