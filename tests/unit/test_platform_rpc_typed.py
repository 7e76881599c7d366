"""Typed handlers: ``@rpc`` parses the request into the subject's generated model and dumps a reply model, against
the repository's real contracts (ctx.persist.read_stream); and it hands a request to its handler on the event loop."""

import json

import anyio.to_thread
import pytest
from ctxbuild_codec.models.subjects.ctx_persist_history_request import PersistHistoryRequest
from ctxbuild_codec.models.subjects.ctx_persist_read_stream_reply import PersistReadStreamReply
from ctxbuild_codec.models.subjects.ctx_persist_read_stream_request import PersistReadStreamRequest
from ctxbuild_platform import claims, contracts
from ctxbuild_platform.rpc import declarations, dispatch, request_model, rpc
from faststream.nats import NatsBroker, TestNatsBroker

SUBJECT = "ctx.persist.read_stream"


@pytest.fixture(autouse=True)
def real_contracts():
    contracts.reset_cache()
    yield
    contracts.reset_cache()


async def handler(req: PersistReadStreamRequest) -> PersistReadStreamReply:
    assert isinstance(req, PersistReadStreamRequest)
    return PersistReadStreamReply(streamId=req.streamId, events=[], lastVersion=0, nextVersion=1, more=False)


async def test_a_typed_handler_gets_its_model_and_its_reply_is_dumped():
    model = request_model(SUBJECT, handler)
    assert model is PersistReadStreamRequest
    reply = await dispatch(SUBJECT, json.dumps({"streamId": "turn:t1"}).encode(), handler, model)
    assert reply == {"result": {"streamId": "turn:t1", "events": [], "lastVersion": 0, "nextVersion": 1, "more": False}}


async def test_a_reply_model_leaves_unset_fields_absent():
    async def partial(req: PersistReadStreamRequest) -> PersistReadStreamReply:
        return PersistReadStreamReply(streamId=req.streamId, events=[], lastVersion=3, nextVersion=4, more=False)

    reply = await dispatch(SUBJECT, b'{"streamId": "s"}', partial, PersistReadStreamRequest)
    assert set(reply["result"]) == {"streamId", "events", "lastVersion", "nextVersion", "more"}


async def test_an_invalid_request_is_refused_before_the_model_sees_it():
    reply = await dispatch(SUBJECT, b'{"nope": 1}', handler, PersistReadStreamRequest)
    assert reply["error"]["code"] == "invalid-payload"


def test_a_handler_typed_with_another_subjects_model_is_refused_at_registration():
    async def wrong(req: PersistHistoryRequest) -> PersistReadStreamReply:
        raise AssertionError("never called")

    with pytest.raises(TypeError, match=r"ctx\.persist\.read_stream"):
        request_model(SUBJECT, wrong)


def test_an_untyped_handler_takes_the_plain_value():
    async def plain(payload):
        return payload

    assert request_model(SUBJECT, plain) is None


# The message parameter of @rpc's subscriber (``OnLoop``, a public fast_depends ``CustomField`` around
# ``faststream.Context("message")``) is resolved on the event loop: no worker-thread hop per request. Pinned through
# FastStream's in-memory test broker: if FastStream or fast_depends change how a custom field is resolved, this
# fails (the reply still comes, but through a worker thread).

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
    rpc(broker, SUBJECT, queue="persistence")(handler)
    assert broker.subscribers == []  # the runtime broker only gets the lean server; the declaration is elsewhere
    async with TestNatsBroker(declarations(broker)) as br:
        reply = await br.request(json.dumps({"streamId": "turn:t1"}).encode(), SUBJECT, timeout=5)
    assert json.loads(reply.body) == {
        "result": {"streamId": "turn:t1", "events": [], "lastVersion": 0, "nextVersion": 1, "more": False}}
    assert hops == []
