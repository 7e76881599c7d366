"""/v1/whoami and /v1/keys: the caller, and API keys (admin scope)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query
from fastapi.routing import APIRoute

from ..app.edge import Edge
from ..domain.keys import TENANT_PATTERN, Principal
from .common import Caller
from .models import ApiError, CreateKey

ADMIN_ONLY: dict[int | str, dict[str, Any]] = {
    403: {"model": ApiError, "description": "the credential has no admin scope"}}


def admin_only(who: Principal) -> None:
    if not who.admin:
        raise HTTPException(403, "this credential has no admin scope (managing keys needs an admin key)")


def router(edge: Edge, route_class: type[APIRoute]) -> APIRouter:
    api = APIRouter(route_class=route_class, tags=["keys"])

    @api.get("/whoami")
    async def whoami(who: Caller) -> dict[str, Any]:
        """The authenticated caller: its tenant and whether it may manage keys."""
        return {"subject": who.subject, "tenantId": who.tenant, "admin": who.admin}

    @api.post("/keys", status_code=201, responses=ADMIN_ONLY)
    async def create_key(body: CreateKey, who: Caller) -> dict[str, Any]:
        """Issue an API key for a tenant. The key is in this reply only: it is stored as an argon2id hash."""
        admin_only(who)
        limits = {k: v for k, v in (("requestsPerSecond", body.requestsPerSecond),
                                    ("maxRunningTurns", body.maxRunningTurns)) if v is not None}
        return await edge.create_key(who, body.tenantId, body.name, body.admin, limits)

    @api.get("/keys", responses=ADMIN_ONLY)
    async def list_keys(who: Caller, tenant: Annotated[str | None, Query(max_length=128, pattern=TENANT_PATTERN)]
                        = None, revoked: bool = False) -> dict[str, Any]:
        """Issued keys (never their secrets), newest last; ``revoked`` includes revoked ones."""
        admin_only(who)
        return {"keys": await edge.list_keys(tenant, revoked)}

    @api.delete("/keys/{key_id}", responses=ADMIN_ONLY)
    async def revoke_key(key_id: Annotated[str, Path(pattern=r"^[0-9a-f]{16}$")], who: Caller) -> dict[str, Any]:
        """Revoke a key: refused at once by this replica, by every replica within CTX_AUTH_CACHE_S."""
        admin_only(who)
        await edge.revoke_key(who, key_id)
        return {"keyId": key_id, "revoked": True}

    return api
