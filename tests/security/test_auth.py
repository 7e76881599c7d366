"""Authentication and tenants at the HTTP edge (SPEC §15.3, issue #15) on the real stack: missing, malformed,
forged and revoked credentials; another tenant's key on every conversation route (404, the same body as a missing
conversation, the victim's secret nowhere); OIDC/JWT bearer tokens against a local JWKS server with a key pair made
here; the per-key limits (429 + Retry-After); keys hashed at rest. Each item is one attack (marker ``security``)."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from ctxbuild_devstack import free_port
from ctxbuild_devstack.replica import Replica
from security_support import Edge, start_all, stream_version, uid, victim_conversation
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.support.auth import AUTH
from tests.support.server import ThreadedServer

pytestmark = [pytest.mark.security, pytest.mark.e2e]

ISSUER, AUDIENCE, KID = "https://issuer.test.invalid", "ctxbuild-api", "test-key-1"
# a work-queue stream no runner consumes: a turn admitted on the auth edge replica stays running
STREAM, SUBJECT = "CTX_TURNS_AUTH_TEST", "ctx.turn.run_auth_test"


def bearer(credential: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {credential}"}


@pytest.fixture(scope="module")
def base(stack, start_service) -> str:
    return start_all(stack, start_service)


@pytest.fixture(scope="module")
def admin(stack, base) -> dict[str, str]:
    return bearer(stack.env["CTX_ADMIN_API_KEY"])


def issue(base: str, admin: dict[str, str], tenant: str, **extra: Any) -> dict[str, Any]:
    r = httpx.post(f"{base}/v1/keys", headers=admin, json={"tenantId": tenant, **extra}, timeout=30)
    assert r.status_code == 201, r.text
    return r.json()


@pytest.fixture(scope="module")
def victim(base, admin) -> dict[str, Any]:
    """Tenant A's conversation: a secret attachment, an answered turn that read it (ids of every kind)."""
    key = issue(base, admin, "tenant-a-" + uid()[:8], name="victim")["key"]
    edge = Edge(base, bearer(key))
    v = victim_conversation(edge)
    msgs = edge.messages(v["cid"])
    tool_msg = next(m for m in msgs if m["role"] == "tool")
    v["message"] = tool_msg["id"]
    v["call"] = next(p["toolCallId"] for p in tool_msg["parts"] if p.get("type") == "tool-result")
    v["key"] = key
    return v


@pytest.fixture(scope="module")
def attacker(base, admin) -> dict[str, str]:
    return bearer(issue(base, admin, "tenant-b-" + uid()[:8], name="attacker")["key"])


# every conversation route: (method, path under /v1/conversations/{cid}, request kwargs)
ROUTES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "messages": ("GET", "/messages", {}),
    "messages-branches": ("GET", "/messages?branches=true", {}),
    "attachment": ("POST", "/attachments", {"files": {"file": ("x.txt", b"planted", "text/plain")}}),
    "turn": ("POST", "/turns", {"json": {"text": "hi", "provider": {"kind": "replay", "script": [{"text": "x"}]}}}),
    "regenerate": ("POST", "/turns/{turn}/regenerate", {"json": {}}),
    "abort": ("POST", "/turns/{turn}/abort", {"json": {"reason": "x"}}),
    "events": ("GET", "/turns/{turn}/events", {}),
    "turn-log": ("GET", "/turns/{turn}", {}),
    "served-request": ("GET", "/turns/{turn}/steps/1/request", {}),
    "tool-result": ("GET", "/messages/{message}/results/{call}", {}),
}


def call(base: str, route: str, cid: str, v: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
    method, path, kwargs = ROUTES[route]
    url = f"{base}/v1/conversations/{cid}" + path.format(turn=v["turn"], message=v["message"], call=v["call"])
    return httpx.request(method, url, headers=headers, timeout=60, **kwargs)


def unauthenticated(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"].startswith("Bearer")
    body = r.json()
    assert body["code"] == "unauthenticated" and body["retryable"] is False and body["message"]


# ---------------------------------------------------------------- no credential, bad credentials
@pytest.mark.parametrize("route", list(ROUTES))
def test_a_conversation_route_without_a_credential_is_401(base, victim, route):
    r = call(base, route, victim["cid"], victim, {})
    unauthenticated(r)
    assert victim["marker"] not in r.text


@pytest.mark.parametrize("method,path", [("POST", "/v1/conversations"), ("GET", "/v1/keys"), ("POST", "/v1/keys"),
                                         ("DELETE", "/v1/keys/0123456789abcdef"), ("GET", "/v1/whoami"),
                                         ("GET", "/v1/no-such-route")])
def test_every_other_v1_route_without_a_credential_is_401(base, method, path):
    unauthenticated(httpx.request(method, f"{base}{path}", timeout=30, json={}))


def test_health_endpoints_stay_open(base):
    assert httpx.get(f"{base}/healthz", timeout=10).status_code == 200
    assert httpx.get(f"{base}/readyz", timeout=10).status_code == 200


MALFORMED = {
    "bearer-without-value": {"Authorization": "Bearer"},
    "basic-scheme": {"Authorization": "Basic " + base64.b64encode(b"user:pass").decode()},
    "token-without-scheme": {"Authorization": "ctx_0123456789abcdef_" + "a" * 43},
    "short-key": bearer("ctx_123"),
    "key-id-not-hex": bearer("ctx_ZZZZZZZZZZZZZZZZ_" + "a" * 43),
    "random-garbage": bearer("not a key at all"),
    "x-api-key-empty": {"x-api-key": ""},
    "nul-in-key": {"x-api-key": "ctx_0123456789abcdef_" + "a" * 20 + "%00"},
    "jwt-shape-without-oidc": bearer("eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0.c2ln"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_credential_is_401(base, case):
    unauthenticated(httpx.post(f"{base}/v1/conversations", headers=MALFORMED[case], json={}, timeout=30))


def test_a_forged_secret_for_a_real_key_id_is_401(base, admin):
    real = issue(base, admin, "tenant-forge")
    forged = f"ctx_{real['keyId']}_" + "A" * len(real["key"].split("_", 2)[2])
    unauthenticated(httpx.get(f"{base}/v1/whoami", headers=bearer(forged), timeout=30))
    # the real one works: the refusal is about the secret
    assert httpx.get(f"{base}/v1/whoami", headers=bearer(real["key"]), timeout=30).status_code == 200


def test_a_forged_secret_after_the_real_key_was_cached_is_401(base, admin):
    real = issue(base, admin, "tenant-forge-cached")
    assert httpx.get(f"{base}/v1/whoami", headers=bearer(real["key"]), timeout=30).status_code == 200
    secret = real["key"].split("_", 2)[2]
    forged = f"ctx_{real['keyId']}_{secret[:-1]}{'B' if secret[-1] != 'B' else 'C'}"
    unauthenticated(httpx.get(f"{base}/v1/whoami", headers=bearer(forged), timeout=30))


def test_a_flood_of_forged_secrets_for_one_key_id_stops_being_hashed(base, admin):
    """Each wrong secret costs the edge an argon2 hash: past 30 a minute for one key id (the default of
    CTX_KEY_FAILED_VERIFICATIONS_PER_MINUTE) they are refused at once (429), however slow the hashing; the owner,
    verified a moment ago, goes on."""
    real = issue(base, admin, "tenant-flood")
    assert httpx.get(f"{base}/v1/whoami", headers=bearer(real["key"]), timeout=30).status_code == 200
    forged = f"ctx_{real['keyId']}_" + "F" * 43
    seen = []
    with httpx.Client(timeout=30) as http:
        for _ in range(60):
            r = http.get(f"{base}/v1/whoami", headers=bearer(forged))
            seen.append(r.status_code)
            if r.status_code == 429:
                break
    assert seen[0] == 401 and seen[-1] == 429 and set(seen) == {401, 429}, seen
    assert int(r.headers["retry-after"]) >= 1
    assert httpx.get(f"{base}/v1/whoami", headers=bearer(real["key"]), timeout=30).status_code == 200


def test_a_key_id_that_was_never_issued_is_401(base):
    unauthenticated(httpx.get(f"{base}/v1/whoami", headers=bearer("ctx_0123456789abcdef_" + "a" * 43), timeout=30))


def test_a_revoked_key_is_refused_at_once_and_listed_as_revoked(base, admin):
    k = issue(base, admin, "tenant-revoke", name="to revoke")
    assert httpx.post(f"{base}/v1/conversations", headers=bearer(k["key"]), json={}, timeout=30).status_code == 201
    r = httpx.delete(f"{base}/v1/keys/{k['keyId']}", headers=admin, timeout=30)
    assert r.status_code == 200 and r.json() == {"keyId": k["keyId"], "revoked": True}
    unauthenticated(httpx.post(f"{base}/v1/conversations", headers=bearer(k["key"]), json={}, timeout=30))
    listed = httpx.get(f"{base}/v1/keys", headers=admin, params={"tenant": "tenant-revoke", "revoked": "true"},
                       timeout=30).json()["keys"]
    assert [x["revokedAt"] is not None for x in listed if x["keyId"] == k["keyId"]] == [True]
    active = httpx.get(f"{base}/v1/keys", headers=admin, params={"tenant": "tenant-revoke"}, timeout=30).json()
    assert k["keyId"] not in {x["keyId"] for x in active["keys"]}


def test_the_key_works_in_both_headers(base, admin):
    k = issue(base, admin, "tenant-headers")
    for headers in (bearer(k["key"]), {"x-api-key": k["key"]}):
        r = httpx.get(f"{base}/v1/whoami", headers=headers, timeout=30)
        assert r.status_code == 200 and r.json()["tenantId"] == "tenant-headers" and r.json()["admin"] is False


@pytest.mark.parametrize("method,path", [("POST", "/v1/keys"), ("GET", "/v1/keys"),
                                         ("DELETE", "/v1/keys/0123456789abcdef")])
def test_a_tenant_key_cannot_manage_keys(base, method, path):
    r = httpx.request(method, f"{base}{path}", headers=AUTH, json={"tenantId": "mine"}, timeout=30)
    assert r.status_code == 403, r.text
    assert r.json()["code"] == "forbidden"


def test_a_tenant_key_cannot_mint_an_admin_key(base, admin):
    k = issue(base, admin, "tenant-escalate")
    r = httpx.post(f"{base}/v1/keys", headers=bearer(k["key"]), json={"tenantId": "tenant-escalate", "admin": True},
                   timeout=30)
    assert r.status_code == 403


# ---------------------------------------------------------------- another tenant: 404 like a missing conversation
@pytest.mark.parametrize("route", list(ROUTES))
async def test_another_tenants_key_gets_the_missing_conversation_answer(base, victim, attacker, pg, route):
    before = {s: await stream_version(pg, s) for s in (f"conversation:{victim['cid']}",
                                                       f"conversation-turns:{victim['cid']}", f"turn:{victim['turn']}")}
    r = call(base, route, victim["cid"], victim, attacker)
    missing_cid = "conv_" + uid()
    missing = call(base, route, missing_cid, victim, attacker)
    assert r.status_code == missing.status_code == 404, (r.text, missing.text)
    assert r.text.replace(victim["cid"], "<cid>") == missing.text.replace(missing_cid, "<cid>")
    assert r.json()["code"] == "not-found"
    assert victim["marker"] not in r.text and victim["turn"] not in r.text
    # nothing of the attacker's was stored in the victim's conversation
    after = {s: await stream_version(pg, s) for s in before}
    assert after == before
    # the owner still reads it (the refusal was about who asks)
    if ROUTES[route][0] == "GET" and route != "events":
        assert call(base, route, victim["cid"], victim, bearer(victim["key"])).status_code == 200


def test_a_conversation_belongs_to_the_tenant_that_created_it(base, admin, pg):
    k = issue(base, admin, "tenant-owner")
    cid = httpx.post(f"{base}/v1/conversations", headers=bearer(k["key"]), json={}, timeout=30).json()["id"]
    # another key of the same tenant reads it; the session's tenant does not
    k2 = issue(base, admin, "tenant-owner")
    reader = httpx.get(f"{base}/v1/conversations/{cid}/messages", headers=bearer(k2["key"]), timeout=30)
    assert reader.status_code == 200
    assert httpx.get(f"{base}/v1/conversations/{cid}/messages", headers=AUTH, timeout=30).status_code == 404


async def test_the_tenant_is_recorded_in_conversation_created(base, admin, pg):
    k = issue(base, admin, "tenant-recorded")
    cid = httpx.post(f"{base}/v1/conversations", headers=bearer(k["key"]), json={}, timeout=30).json()["id"]
    data = await pg.fetchval("SELECT data::text FROM persistence.events WHERE stream_id = $1 AND version = 1",
                             f"conversation:{cid}")
    assert json.loads(data)["tenantId"] == "tenant-recorded"


# ---------------------------------------------------------------- keys at rest
async def test_a_key_is_stored_as_an_argon2_hash_never_the_secret(base, admin, pg):
    k = issue(base, admin, "tenant-at-rest", name="hash me")
    secret = k["key"].split("_", 2)[2]
    rows = await pg.fetch("SELECT type, data::text AS data FROM persistence.events WHERE stream_id = $1",
                          f"apikey:{k['keyId']}")
    assert [r["type"] for r in rows] == ["ApiKeyIssued"]
    stored = json.loads(rows[0]["data"])
    assert stored["secretHash"].startswith("$argon2id$")
    leaked = await pg.fetchval("SELECT count(*) FROM persistence.events WHERE data::text LIKE $1 "
                               "OR metadata::text LIKE $1", f"%{secret}%")
    assert leaked == 0
    listed = httpx.get(f"{base}/v1/keys", headers=admin, params={"tenant": "tenant-at-rest"}, timeout=30).text
    assert secret not in listed and "argon2" not in listed and k["keyId"] in listed


# ---------------------------------------------------------------- limits
def test_over_the_keys_requests_per_second_is_429_with_retry_after(base, admin):
    k = issue(base, admin, "tenant-rps", requestsPerSecond=1)
    seen = []
    for _ in range(50):  # one request per second is allowed: the next ones in the same second are refused
        r = httpx.get(f"{base}/v1/whoami", headers=bearer(k["key"]), timeout=30)
        seen.append(r.status_code)
        if r.status_code == 429:
            break
    assert seen[0] == 200 and seen[-1] == 429, seen
    assert int(r.headers["retry-after"]) >= 1
    assert r.json() == {"code": "rate-limited", "message": r.json()["message"], "retryable": True}
    # another key is not affected
    assert httpx.get(f"{base}/v1/whoami", headers=AUTH, timeout=30).status_code == 200


@pytest.fixture(scope="module")
def jwks():
    """A local OIDC JWKS server with an RSA key pair made here (and a second pair it does not publish)."""
    key, other = (rsa.generate_private_key(public_exponent=65537, key_size=2048) for _ in range(2))
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
    jwk.update(kid=KID, use="sig", alg="RS256")

    async def keys(_: Request) -> JSONResponse:
        return JSONResponse({"keys": [jwk]})

    port = free_port()
    server = ThreadedServer(Starlette(routes=[Route("/jwks.json", keys)]), port).start()
    yield {"url": f"http://127.0.0.1:{port}/jwks.json", "key": key, "other": other}
    server.stop()


@pytest.fixture(scope="module")
def auth_edge(stack, base, jwks):
    """An edge-only replica with OIDC configured and its own work queue (no runner takes its turns: they stay
    running, which is what the running-turn limit counts)."""
    e = Replica(stack, "orchestration", "orch-auth-edge", CTX_ROLE="edge", CTX_TURNS_STREAM=STREAM,
                CTX_TURNS_SUBJECT=SUBJECT, CTX_TURNS_CONSUMER="auth-test-runner",
                CTX_OIDC_JWKS_URL=jwks["url"], CTX_OIDC_ISSUER=ISSUER, CTX_OIDC_AUDIENCE=AUDIENCE,
                CTX_OIDC_TENANT_CLAIM="org").wait_ready()
    yield e.url
    e.stop()


def test_over_the_keys_running_turns_is_429_with_retry_after(auth_edge, admin):
    k = bearer(issue(auth_edge, admin, "tenant-turns", maxRunningTurns=1)["key"])
    script = {"kind": "replay", "script": [{"text": "never runs"}]}
    first = httpx.post(f"{auth_edge}/v1/conversations", headers=k, json={}, timeout=30).json()["id"]
    assert httpx.post(f"{auth_edge}/v1/conversations/{first}/turns", headers=k, timeout=30,
                      json={"text": "one", "provider": script}).status_code == 202
    second = httpx.post(f"{auth_edge}/v1/conversations", headers=k, json={}, timeout=30).json()["id"]
    r = httpx.post(f"{auth_edge}/v1/conversations/{second}/turns", headers=k, timeout=30,
                   json={"text": "two", "provider": script})
    assert r.status_code == 429, r.text
    assert int(r.headers["retry-after"]) >= 1
    assert r.json()["code"] == "rate-limited" and r.json()["retryable"] is True
    # the refused turn left nothing behind; another key of the tenant still starts one
    msgs = httpx.get(f"{auth_edge}/v1/conversations/{second}/messages", headers=k, timeout=30).json()["messages"]
    assert msgs == []
    other = bearer(issue(auth_edge, admin, "tenant-turns")["key"])
    assert httpx.post(f"{auth_edge}/v1/conversations/{second}/turns", headers=other, timeout=30,
                      json={"text": "two", "provider": script}).status_code == 202


# ---------------------------------------------------------------- OIDC / JWT bearer tokens
def token(jwks: dict[str, Any], *, key: Any = None, alg: str = "RS256", **claims: Any) -> str:
    now = int(time.time())
    payload = {"iss": ISSUER, "aud": AUDIENCE, "sub": "user-" + uid()[:6], "org": "tenant-jwt", "iat": now,
               "exp": now + 600, **claims}
    payload = {k: v for k, v in payload.items() if v is not None}
    return jwt.encode(payload, key if key is not None else jwks["key"], algorithm=alg, headers={"kid": KID})


def test_a_valid_token_authenticates_its_tenant(auth_edge, jwks):
    r = httpx.get(f"{auth_edge}/v1/whoami", headers=bearer(token(jwks)), timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["tenantId"] == "tenant-jwt" and r.json()["admin"] is False


def test_a_tokens_conversation_is_404_to_another_tenants_token(auth_edge, jwks):
    mine = bearer(token(jwks, org="tenant-jwt-a"))
    cid = httpx.post(f"{auth_edge}/v1/conversations", headers=mine, json={}, timeout=30).json()["id"]
    assert httpx.get(f"{auth_edge}/v1/conversations/{cid}/messages", headers=mine, timeout=30).status_code == 200
    theirs = httpx.get(f"{auth_edge}/v1/conversations/{cid}/messages", headers=bearer(token(jwks, org="tenant-jwt-b")),
                       timeout=30)
    assert theirs.status_code == 404 and theirs.json()["code"] == "not-found"


BAD_TOKENS = {
    "expired": lambda j: token(j, exp=int(time.time()) - 120, iat=int(time.time()) - 900),
    "wrong-audience": lambda j: token(j, aud="someone-else"),
    "wrong-issuer": lambda j: token(j, iss="https://evil.test.invalid"),
    "bad-signature": lambda j: token(j, key=j["other"]),
    "no-expiry": lambda j: token(j, exp=None),
    "no-tenant-claim": lambda j: token(j, org=None),
    "tenant-claim-not-an-id": lambda j: token(j, org="../other tenant"),
    "alg-none": lambda j: jwt.encode({"iss": ISSUER, "aud": AUDIENCE, "sub": "x", "org": "tenant-jwt",
                                      "exp": int(time.time()) + 600}, None, algorithm="none", headers={"kid": KID}),
    "hs256-with-the-public-key": lambda j: _hs256_confusion(j),
    "tampered-payload": lambda j: _tampered(token(j)),
}


def _hs256_confusion(j: dict[str, Any]) -> str:
    """Algorithm confusion: HS256 keyed with the published public key's JWK (anyone can fetch it)."""
    header = {"alg": "HS256", "typ": "JWT", "kid": KID}
    payload = {"iss": ISSUER, "aud": AUDIENCE, "sub": "x", "org": "tenant-jwt", "exp": int(time.time()) + 600}
    import hashlib
    import hmac

    def b64(raw: bytes) -> str:
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    signing = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(payload).encode())}"
    secret = jwt.algorithms.RSAAlgorithm.to_jwk(j["key"].public_key()).encode()
    return f"{signing}.{b64(hmac.new(secret, signing.encode(), hashlib.sha256).digest())}"


def _tampered(tok: str) -> str:
    head, body, sig = tok.split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    claims["org"] = "tenant-victim"
    forged = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"{head}.{forged}.{sig}"


@pytest.mark.parametrize("case", list(BAD_TOKENS))
def test_a_bad_token_is_401(auth_edge, jwks, case):
    unauthenticated(httpx.post(f"{auth_edge}/v1/conversations", headers=bearer(BAD_TOKENS[case](jwks)), json={},
                               timeout=30))
