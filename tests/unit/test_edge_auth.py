"""The edge's authenticator (auth.py) as pure logic: key format, verification against a key's events, the
verification cache and what revocation does to it, the running-turn count. The key streams here are plain lists;
tests/security/test_auth.py runs the same code against the real stack."""

from __future__ import annotations

import re

import pytest
from argon2 import PasswordHasher
from ctxbuild_orchestration.adapters.auth import AuthConfig, Authenticator
from ctxbuild_orchestration.domain.keys import KEY_FORMAT as _KEY
from ctxbuild_orchestration.domain.keys import Principal, new_key
from fastapi import HTTPException

FAST = PasswordHasher(time_cost=1, memory_cost=8, parallelism=1)  # unit tests only: the service uses the defaults


def authenticator(streams: dict[str, list[dict]], **config) -> Authenticator:
    async def read(stream: str) -> list[dict]:
        return list(streams.get(stream, []))

    return Authenticator(AuthConfig(**config), read, hasher=FAST)


def issued(streams: dict[str, list[dict]], tenant: str = "t1", **extra) -> str:
    key_id, secret, key = new_key()
    streams[f"apikey:{key_id}"] = [{"type": "ApiKeyIssued", "data": {
        "keyId": key_id, "tenantId": tenant, "secretHash": FAST.hash(secret), **extra}}]
    return key


def test_a_new_key_has_the_documented_shape():
    key_id, secret, key = new_key()
    assert re.fullmatch(r"[0-9a-f]{16}", key_id) and key == f"ctx_{key_id}_{secret}"
    assert _KEY.match(key).groups() == (key_id, secret)


async def test_a_key_authenticates_its_tenant_and_limits():
    streams: dict[str, list[dict]] = {}
    key = issued(streams, "acme", admin=True, limits={"requestsPerSecond": 3, "maxRunningTurns": 2})
    who = await authenticator(streams).authenticate(key)
    assert (who.tenant, who.admin, who.requests_per_second, who.max_running_turns) == ("acme", True, 3, 2)


@pytest.mark.parametrize("credential", ["", None, "ctx_nothex_abc", "Bearer x", "ctx_0123456789abcdef_" + "a" * 43])
async def test_bad_credentials_are_401_with_a_challenge(credential):
    with pytest.raises(HTTPException) as refused:
        await authenticator({}).authenticate(credential)
    assert refused.value.status_code == 401 and refused.value.headers["WWW-Authenticate"].startswith("Bearer")


async def test_a_cached_key_does_not_accept_another_secret():
    streams: dict[str, list[dict]] = {}
    key = issued(streams)
    auth = authenticator(streams, cache_s=60)
    await auth.authenticate(key)
    with pytest.raises(HTTPException):
        await auth.authenticate(key[:-1] + ("A" if key[-1] != "A" else "B"))


async def test_revocation_reaches_a_replica_once_its_cache_entry_is_gone():
    streams: dict[str, list[dict]] = {}
    key = issued(streams)
    key_id = key.split("_")[1]
    other_replica, revoking_replica = authenticator(streams, cache_s=60), authenticator(streams, cache_s=60)
    await other_replica.authenticate(key)
    await revoking_replica.authenticate(key)
    streams[f"apikey:{key_id}"].append({"type": "ApiKeyRevoked", "data": {"keyId": key_id}})
    revoking_replica.forget(key_id)
    with pytest.raises(HTTPException):
        await revoking_replica.authenticate(key)  # at once where it was revoked
    assert (await other_replica.authenticate(key)).tenant == "t1"  # elsewhere: until the cache bound
    no_cache = authenticator(streams, cache_s=0)
    with pytest.raises(HTTPException):
        await no_cache.authenticate(key)


async def test_the_admin_key_is_admin():
    who = await authenticator({}, admin_key="ctxadmin_secret").authenticate("ctxadmin_secret")
    assert who.admin and who.tenant == "admin"
    with pytest.raises(HTTPException):
        await authenticator({}, admin_key="ctxadmin_secret").authenticate("ctxadmin_secreT")


async def test_running_turns_are_counted_until_they_end():
    auth = authenticator({}, max_running_turns=2)
    who = Principal("key:x", "t")
    ended: set[str] = set()

    async def running(turn: str) -> bool:
        return turn not in ended

    await auth.admit_turn(who, "t1", running)
    await auth.admit_turn(who, "t2", running)
    with pytest.raises(HTTPException) as refused:
        await auth.admit_turn(who, "t3", running)
    assert refused.value.status_code == 429 and int(refused.value.headers["Retry-After"]) >= 1
    ended.add("t1")
    await auth.admit_turn(who, "t3", running)
    auth.turn_not_started(who, "t3")
    await auth.admit_turn(who, "t4", running)  # t3 was handed back


async def test_over_the_rate_is_429_with_retry_after():
    auth = authenticator({})
    who = Principal("key:y", "t", requests_per_second=2)
    await auth.check_rate(who)
    await auth.check_rate(who)
    with pytest.raises(HTTPException) as refused:
        for _ in range(50):  # the window is one second: at most 2 of these pass within it
            await auth.check_rate(who)
    assert refused.value.status_code == 429 and int(refused.value.headers["Retry-After"]) >= 1


async def test_wrong_secrets_for_one_key_id_stop_being_hashed_and_the_cached_owner_goes_on():
    streams: dict[str, list[dict]] = {}
    key = issued(streams)
    auth = authenticator(streams, cache_s=60, failed_verifications_per_minute=5)
    await auth.authenticate(key)  # the owner, verified and cached
    wrong = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    statuses = []
    for _ in range(50):  # past the per-minute bound failures are refused at once, without a hash
        with pytest.raises(HTTPException) as refused:
            await auth.authenticate(wrong)
        statuses.append(refused.value.status_code)
        if refused.value.status_code == 429:
            break
    assert statuses[0] == 401 and statuses[-1] == 429, statuses
    assert (await auth.authenticate(key)).tenant == "t1"


async def test_a_flood_of_wrong_secrets_does_not_lock_out_the_owner_once_the_cache_has_lapsed():
    streams: dict[str, list[dict]] = {}
    key = issued(streams)
    auth = authenticator(streams, cache_s=0, failed_verifications_per_minute=3)  # nothing is trusted unhashed
    await auth.authenticate(key)
    wrong = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    statuses = []
    for _ in range(5):
        with pytest.raises(HTTPException) as refused:
            await auth.authenticate(wrong)
        statuses.append(refused.value.status_code)
    assert statuses == [401, 401, 401, 429, 429]
    assert (await auth.authenticate(key)).tenant == "t1"  # the secret verified last still passes
    other = issued(streams)  # a never-verified secret of another key id is not affected either
    assert (await auth.authenticate(other)).tenant == "t1"


class CountingHasher(PasswordHasher):
    def __init__(self) -> None:
        super().__init__(time_cost=1, memory_cost=8, parallelism=1)
        self.verified = 0

    def verify(self, hash, password) -> bool:
        self.verified += 1
        return super().verify(hash, password)


async def test_a_lapsed_entry_rereads_the_key_but_does_not_hash_the_same_secret_again():
    """Once the cache period is over the key's stream is read again — a revocation since is seen — but a secret
    this replica verified against the stored hash is not hashed again (the slow hash once per secret, not once
    per period); another secret, or the same one against another stored hash, is."""
    streams: dict[str, list[dict]] = {}
    key = issued(streams)
    key_id = key.split("_")[1]
    reads: list[str] = []

    async def read(stream: str) -> list[dict]:
        reads.append(stream)
        return list(streams.get(stream, []))

    hasher = CountingHasher()
    auth = Authenticator(AuthConfig(cache_s=0), read, hasher=hasher)
    for _ in range(3):
        assert (await auth.authenticate(key)).tenant == "t1"
    assert hasher.verified == 1 and reads == [f"apikey:{key_id}"] * 3
    wrong = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    with pytest.raises(HTTPException):
        await auth.authenticate(wrong)
    assert hasher.verified == 2
    assert (await auth.authenticate(key)).tenant == "t1" and hasher.verified == 2
    secret = key.split("_", 2)[2]
    streams[f"apikey:{key_id}"][0]["data"]["secretHash"] = FAST.hash(secret)  # another hash of the same secret
    assert (await auth.authenticate(key)).tenant == "t1" and hasher.verified == 3
    streams[f"apikey:{key_id}"].append({"type": "ApiKeyRevoked", "data": {"keyId": key_id}})
    with pytest.raises(HTTPException) as refused:
        await auth.authenticate(key)
    assert refused.value.status_code == 401 and hasher.verified == 3
