"""Request/reply over core NATS with contract validation on both ends of every subject.

Server side: ``@rpc(broker, "ctx.blob.put")`` wraps a handler ``async (payload: dict) -> dict``. The request is
validated against ``contracts/subjects/<subject>.request.json`` and the result against ``….reply.json``; the
reply is ``{"result": …}`` or ``{"error": {code, message, retryable}}``. One queue group per service, so
replicas share the load.

Client side: :class:`RpcClient` sends, decodes, and raises :class:`RemoteError` for an error reply, a timeout or
no responders (both retryable).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import structlog
from faststream._internal.context import Context  # the class behind faststream.Context(): subclassed below
from faststream.nats import NatsBroker
from faststream.nats.message import NatsMessage
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from . import contracts
from .errors import InvalidPayload, RemoteError, ServiceError

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
log = structlog.get_logger("rpc")


def decode(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidPayload(f"payload is not JSON: {exc}") from exc


async def dispatch(subject: str, raw: bytes, fn: Handler) -> dict[str, Any]:
    """Validate, run, validate, wrap. Pure apart from the handler: unit-testable without a broker."""
    try:
        payload = decode(raw)
        contracts.validate(contracts.subject_contract(subject, "request"), payload)
        result = await fn(payload)
        contracts.validate(contracts.subject_contract(subject, "reply"), result)
        return {"result": result}
    except ServiceError as exc:
        if exc.code == "invalid-payload":
            log.warning("rejected", subject=subject, error=exc.message)
        else:
            log.info("error-reply", subject=subject, code=exc.code, error=exc.message)
        return {"error": exc.to_payload()}
    except Exception as exc:
        log.exception("handler-crashed", subject=subject)
        return {"error": {"code": "internal", "message": f"{type(exc).__name__}: {exc}"[:500], "retryable": False}}


class _LoopContext(Context):
    """FastStream's ``Context`` resolved on the event loop. fast_depends runs a custom field's synchronous ``use``
    on a worker thread — for ``NatsMessage`` that was a thread hop per request (~0.1 ms, more on a busy machine);
    an async ``use`` is awaited in place. The handler's signature is unchanged for FastStream (a context
    parameter, no payload schema), so the generated AsyncAPI document stays the same."""

    async def use(self, /, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return super().use(**kwargs)


def rpc(broker: NatsBroker, subject: str, *, queue: str, max_workers: int = 16,
        description: str | None = None) -> Callable[[Handler], Handler]:
    def deco(fn: Handler) -> Handler:
        async def handler(message: Annotated[NatsMessage, _LoopContext("message")]) -> dict[str, Any]:
            return await dispatch(subject, message.body, fn)

        handler.__name__ = fn.__name__
        handler.__doc__ = fn.__doc__
        broker.subscriber(subject, queue=queue, max_workers=max_workers,
                          title=subject, description=description or fn.__doc__)(handler)
        return fn

    return deco


class RpcClient:
    """Calls other services' subjects through a connected FastStream NATS broker."""

    def __init__(self, broker: NatsBroker, default_timeout: float = 10.0) -> None:
        self.broker = broker
        self.default_timeout = default_timeout

    async def call(self, subject: str, payload: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        try:
            msg = await self.broker.request(body, subject, timeout=timeout or self.default_timeout,
                                            headers={"content-type": "application/json"})
        except NoRespondersError as exc:
            raise RemoteError(subject, "unavailable", "no responders", True) from exc
        except (NatsTimeout, TimeoutError) as exc:
            raise RemoteError(subject, "timeout", "request timed out", True) from exc
        reply = decode(msg.body)
        if "error" in reply:
            e = reply["error"]
            raise RemoteError(subject, e.get("code", "internal"), e.get("message", ""), bool(e.get("retryable")),
                              e.get("details"))
        return reply["result"]
