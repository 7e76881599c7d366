"""Every refusal in the API's error shape ``{code, message, retryable}``: typed service errors, request validation
(422 ``invalid-payload``) and the framework's own (unknown route, body over its limit → 413)."""

from __future__ import annotations

from ctxbuild_platform.errors import RemoteError, ServiceError
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..adapters.auth import Authenticator, credential_of
from ..app.edge import safe_text

STATUS = {"invalid-payload": 422, "not-found": 404, "version-conflict": 409, "unavailable": 503, "timeout": 504,
          "provider-not-configured": 400, "unsupported-media": 415, "conflict": 409,
          "too-large": 413, "turn-in-progress": 409}
# FastAPI/Starlette's own refusals (unknown route, wrong method, body over its limit, unparsable body), worded
# in the API's error shape
HTTP_CODES = {400: "invalid-payload", 401: "unauthenticated", 403: "forbidden", 404: "not-found",
              405: "method-not-allowed", 413: "too-large", 415: "unsupported-media", 422: "invalid-payload",
              429: "rate-limited"}


def error_response(exc: ServiceError) -> JSONResponse:
    if isinstance(exc, RemoteError):
        # a backend refusing our own request is our fault (502), not the client's (422)
        status = {"not-found": 404, "version-conflict": 409}.get(exc.code, 503 if exc.retryable else 502)
    else:
        status = STATUS.get(exc.code, 500)
    return JSONResponse(exc.to_payload(), status_code=status)


def validation_message(exc: RequestValidationError) -> str:
    """Where and what, never the input itself (it may be megabytes)."""
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(safe_text(x) for x in err.get("loc", ()))
        parts.append(f"{where}: {safe_text(err.get('msg', 'invalid'))}" if where
                     else safe_text(err.get("msg", "invalid")))
    more = len(exc.errors()) - 5
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def install_error_handlers(app: FastAPI, auth: Authenticator | None = None) -> None:
    """Every refusal in the API's error shape (see the module)."""
    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, exc: ServiceError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"code": "invalid-payload", "message": validation_message(exc), "retryable": False},
                            status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if (auth is not None and exc.status_code in (404, 405) and request.url.path.startswith("/v1/")
                and "principal" not in request.scope.get("state", {})):
            # no route matched: under /v1 an unauthenticated caller learns nothing about which routes exist
            try:
                await auth.authenticate(credential_of(request))
            except StarletteHTTPException as refused:
                exc = refused
        code = HTTP_CODES.get(exc.status_code, f"http-{exc.status_code}")
        return JSONResponse({"code": code, "message": safe_text(exc.detail),
                             "retryable": exc.status_code >= 500 or exc.status_code == 429},
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))
