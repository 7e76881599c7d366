"""The claim envelope without a server: header and reply forms, the wire contract, the inline limit."""

from __future__ import annotations

import hashlib
import json

import pytest
from ctxbuild_platform import claims, contracts
from ctxbuild_platform.claims import CLAIM_HEADER, Claim, ClaimStore
from ctxbuild_platform.errors import InvalidPayload


class _Connection:
    """What the store reads from a NATS connection before it needs the server: the announced max_payload."""

    max_payload = 1024 * 1024


@pytest.fixture(autouse=True)
def default_config():
    before = claims.config()
    claims.configure(claims.ClaimConfig())
    yield
    claims.configure(before)


def test_a_claim_names_the_size_and_sha256_of_its_bytes():
    data = "é 漢字 🙂".encode() * 100
    claim = Claim.of(data)
    assert claim.size == len(data) and claim.sha256 == hashlib.sha256(data).hexdigest()
    assert Claim.of(data).key != claim.key  # a fresh key per claim


@pytest.mark.parametrize("shared", [False, True])
def test_header_round_trip(shared):
    claim = Claim.of(b"payload", shared=shared)
    assert Claim.from_header(claim.header()) == claim
    assert ":" not in claim.header() and "\n" not in claim.header()  # a plain NATS header value


@pytest.mark.parametrize("value", ["", "key=k", "key=k;size=x;sha256=" + "0" * 64, "key=;size=1;sha256=" + "0" * 64,
                                   "key=k;size=1;sha256=abc", "nonsense"])
def test_a_malformed_header_is_invalid_payload(value):
    with pytest.raises(InvalidPayload):
        Claim.from_header(value)


def test_reply_form_round_trip_and_matches_the_reply_contract():
    claim = Claim.of(b'{"result":{}}')
    form = claim.reply_form()
    contracts.validate("common/reply.json", form)
    back = Claim.from_reply(json.loads(claims.encode_json(form))["claim"])
    assert (back.key, back.size, back.sha256, back.shared) == (claim.key, claim.size, claim.sha256, False)


@pytest.mark.parametrize("form", [None, {}, {"key": "k", "size": "big", "sha256": "0" * 64},
                                  {"key": "k", "size": -1, "sha256": "0" * 64}])
def test_a_malformed_reply_claim_is_invalid_payload(form):
    with pytest.raises(InvalidPayload):
        Claim.from_reply(form)


def test_the_reply_contract_still_refuses_mixed_or_unknown_forms():
    claim = Claim.of(b"x").reply_form()["claim"]
    for bad in ({"result": {}, "claim": claim}, {"claim": {**claim, "extra": 1}}, {"claim": {**claim, "sha256": "x"}}):
        with pytest.raises(InvalidPayload):
            contracts.validate("common/reply.json", bad)


def test_encode_json_is_compact_utf8_and_survives_a_lone_surrogate():
    assert claims.encode_json({"a": "é"}) == '{"a":"é"}'.encode()
    lone = claims.encode_json({"a": "x\udc80y"})  # not encodable as UTF-8: sent escaped
    assert json.loads(lone) == {"a": "x\udc80y"}


def test_inline_limit_is_max_payload_minus_headroom_unless_configured_lower():
    store = ClaimStore(_Connection())
    assert store.inline_limit() == 1024 * 1024 - claims.HEADROOM_BYTES
    claims.configure(claims.with_config(inline_max_bytes=100))
    assert store.inline_limit() == 100
    claims.configure(claims.with_config(inline_max_bytes=10 * 1024 * 1024))  # never above what the server takes
    assert store.inline_limit() == 1024 * 1024 - claims.HEADROOM_BYTES


async def test_small_bodies_pass_inline_without_the_store():
    store = ClaimStore(_Connection())
    assert await store.outgoing(b'{"x":1}', shared=False) == (b'{"x":1}', {})
    assert await store.incoming(b'{"x":1}', {"content-type": "application/json"}) == b'{"x":1}'
    assert await store.incoming(b'{"x":1}', None) == b'{"x":1}'
    assert await store.reply({"result": {"x": 1}}) == b'{"result":{"x":1}}'
    assert await store.open_reply(b'{"result":{"x":1}}') == {"result": {"x": 1}}


async def test_a_malformed_claim_header_is_refused_before_the_store():
    store = ClaimStore(_Connection())
    with pytest.raises(InvalidPayload):
        await store.incoming(b"", {CLAIM_HEADER: "key=k"})


def test_config_from_settings():
    from ctxbuild_platform.settings import ServiceSettings

    s = ServiceSettings(service_name="t", nats_url="nats://127.0.0.1:4222", claims_bucket="B", claims_max_age_s=60,
                        claims_replicas=3, message_inline_max_bytes=4096)
    cfg = claims.ClaimConfig.from_settings(s)
    assert (cfg.bucket, cfg.max_age_s, cfg.replicas, cfg.inline_max_bytes) == ("B", 60, 3, 4096)
