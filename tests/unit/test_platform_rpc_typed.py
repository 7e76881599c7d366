"""Typed handlers: ``@rpc`` parses the request into the subject's generated model and dumps a reply model, against
the repository's real contracts (ctx.persist.read_stream)."""

import json

import pytest
from ctxbuild_codec.models.subjects.ctx_persist_history_request import PersistHistoryRequest
from ctxbuild_codec.models.subjects.ctx_persist_read_stream_reply import PersistReadStreamReply
from ctxbuild_codec.models.subjects.ctx_persist_read_stream_request import PersistReadStreamRequest
from ctxbuild_platform import contracts
from ctxbuild_platform.rpc import dispatch, request_model

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
