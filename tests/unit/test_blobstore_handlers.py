"""The blob store's subjects are served by typed use cases: each takes its subject's generated request model and
returns its reply model (what `rpc` parses and dumps), and a get_result reply keeps the output's value."""

import typing

import pytest
from ctxbuild_blobstore.app import BlobStore, Collector
from ctxbuild_blobstore.handlers import USE_CASES
from ctxbuild_codec.contract_models import dump, subject_model
from ctxbuild_codec.models.subjects.ctx_blob_get_result_reply import CtxBlobGetResultReply
from ctxbuild_platform import contracts
from ctxbuild_platform.contracts import contracts_dir
from ctxbuild_platform.rpc import request_model

SUBJECTS = [*USE_CASES.items(), ("ctx.blob.gc", "gc")]


@pytest.mark.parametrize(("subject", "use_case"), SUBJECTS)
def test_every_subject_is_a_use_case_typed_by_its_generated_models(subject, use_case):
    owner = Collector(None, None, grace_s=1, upload_stale_s=1) if subject == "ctx.blob.gc" else BlobStore(None, None)
    fn = getattr(owner, use_case)  # registered bound, as `handlers.register` does
    assert request_model(subject, fn) is subject_model(subject, "request")
    returned = typing.get_type_hints(fn)["return"]
    assert issubclass(returned, subject_model(subject, "reply"))
    assert fn.__doc__  # the subject's description in the AsyncAPI document


def test_every_blob_subject_is_served():
    request_contracts = {p.name.removesuffix(".request.json") for p in contracts_dir().glob("subjects/ctx.blob.*")
                         if p.name.endswith(".request.json")}
    assert {s for s, _ in SUBJECTS} == request_contracts


@pytest.mark.parametrize("output", [{"type": "text", "value": "the original"},
                                    {"type": "json", "value": {"a": [1, 2.5, None], "b": "x"}},
                                    {"type": "content", "value": [{"type": "text", "text": "t"}]}])
def test_a_get_result_reply_keeps_the_outputs_value(output):
    reply = dump(CtxBlobGetResultReply.model_validate({"output": output, "gone": []}))
    assert reply == {"output": output, "gone": []}
    contracts.validate("subjects/ctx.blob.get_result.reply.json", reply)
