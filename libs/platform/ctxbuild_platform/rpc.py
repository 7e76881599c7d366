"""Request/reply over core NATS with contract validation on both ends of every subject.

Server side: ``@rpc(broker, "ctx.blob.put")`` wraps a typed handler ``async (req: CtxBlobPutRequest) ->
CtxBlobPutReply`` (the models generated from the contracts, :mod:`ctxbuild_codec.models`). The request is validated
against ``contracts/subjects/<subject>.request.json``, parsed into the handler's model, and the result dumped and
validated against ``….reply.json``; the reply is ``{"result": …}`` or ``{"error": {code, message, retryable}}``.
One queue group per service, so replicas share the load. The subject is served by a :class:`LeanServer` that
:func:`start_servers` subscribes once the broker is connected and :func:`stop_servers` drains before it closes
(the service runner calls both); its FastStream declaration (AsyncAPI, in-memory test broker) is a subscriber on
:func:`declarations`, a broker that never connects.

Client side: :class:`RpcClient` sends, decodes, and raises :class:`RemoteError` for an error reply, a timeout or
no responders (both retryable).

Heartbeats (opt-in per call, for calls that may take long, e.g. a model call): ``call(..., heartbeat_s=s)`` sends
``Ctx-Heartbeat: s`` and waits on an inbox of its own; the server publishes an empty ``Ctx-Progress`` message there
every ``s`` seconds while the handler runs, and the final reply last. A caller that hears nothing for
``LIVENESS_BEATS * s`` gives up with a retryable ``unavailable`` (the replica died with the request) instead of
waiting out the whole timeout. A request waiting for a ``max_workers`` slot on a busy replica is beaten for too (up
to ``max_workers`` such requests per subscription wait this way, each taking the next free slot); only one past
that bound waits unheard, like any request, and is given up after the liveness window (it may still run later).

Both sides claim-check payloads over the inline limit (:mod:`ctxbuild_platform.claims`): a large request travels
as a ``Ctx-Claim`` header and is resolved before validation, a large reply as ``{"claim": …}`` resolved by the
client. Handlers and callers see the same dicts whatever the size.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import typing
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

import structlog
from ctxbuild_codec.contract_models import dump, subject_model
from fast_depends.library import CustomField
from faststream import Context
from faststream.nats import NatsBroker
from faststream.nats.message import NatsMessage
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import MaxPayloadError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from opentelemetry import context as otel_context
from opentelemetry import trace
from pydantic import BaseModel

from . import claims, contracts
from .claims import decode
from .errors import InvalidPayload, PayloadTooLarge, RemoteError, ServiceError
from .telemetry import consume_span, inject_into, publish_span
from .text import LONE_SURROGATE

Handler = Callable[[Any], Awaitable[Any]]
log = structlog.get_logger("rpc")


MAX_DEPTH = 200  # deeper JSON is refused before anything recurses over it (no contract nests this deep)


def unprocessable(value: Any) -> str | None:
    """Why a decoded request cannot be processed by any handler, or None: nesting deeper than ``MAX_DEPTH``, or a
    lone surrogate in a string or key (no UTF-8 encoding: Postgres, S3 and every text column refuse it).
    Iterative, so a hostile depth cannot exhaust the stack. Integers are not bounded here (a tool output may
    hold any JSON number); a service that stores one in a typed column range-checks it (persistence)."""
    stack: list[tuple[Any, int, str]] = [(value, 0, "$")]
    while stack:
        v, depth, where = stack.pop()
        if isinstance(v, str):
            # a lone surrogate is never ASCII, and isascii() does not scan: most strings skip the regex
            if not v.isascii() and (m := LONE_SURROGATE.search(v)) is not None:
                return f"{where} holds a lone surrogate (U+{ord(m.group()):04X}) at index {m.start()}"
        elif isinstance(v, (dict, list)):
            if depth >= MAX_DEPTH:
                return f"{where} nests deeper than {MAX_DEPTH} levels"
            if isinstance(v, dict):
                for k, item in v.items():
                    if not k.isascii() and LONE_SURROGATE.search(k) is not None:
                        return f"a key of {where} holds a lone surrogate"
                    stack.append((item, depth + 1, f"{where}.{k}"[:200]))
            else:
                stack.extend((item, depth + 1, f"{where}[{i}]"[:200]) for i, item in enumerate(v))
    return None


def decode_request(raw: bytes) -> Any:
    """The request's JSON, or ``invalid-payload`` — never a crash on hostile input (deep nesting overflows the
    JSON decoder's recursion)."""
    try:
        payload = decode(raw)
    except RecursionError as exc:
        raise InvalidPayload("payload nests too deeply to decode") from exc
    if not _plainly_processable(raw) and (why := unprocessable(payload)) is not None:
        raise InvalidPayload(f"payload cannot be stored or processed: {why}")
    return payload


def _plainly_processable(raw: bytes) -> bool:
    """Whether the bytes alone prove :func:`unprocessable` would find nothing, so the walk over the decoded value
    can be skipped: fewer brackets than ``MAX_DEPTH`` cannot nest that deep, and in UTF-8 (what ``json.loads``
    takes bytes as unless they start with a BOM or a NUL) a surrogate can only come from a ``\\u`` escape or from
    its (invalid, but decoded with surrogatepass) encoded form, whose first byte is 0xED."""
    return (b"\x00" not in raw[:4] and not raw.startswith((b"\xff\xfe", b"\xfe\xff"))
            and b"\\u" not in raw and b"\xed" not in raw and raw.count(b"[") + raw.count(b"{") < MAX_DEPTH)


def request_model(subject: str, fn: Handler) -> type[BaseModel] | None:
    """The model ``fn`` takes its request as: its first parameter's annotation, which must be the subject's generated
    request model (or a subclass of it); None for a handler that takes the plain JSON value."""
    params = list(inspect.signature(fn).parameters)
    annotation = typing.get_type_hints(fn).get(params[0]) if params else None
    if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return None
    contract = subject_model(subject, "request")
    if not issubclass(annotation, contract):
        raise TypeError(f"{fn.__qualname__} takes {annotation.__name__}, not {subject}'s request {contract.__name__}")
    return annotation


async def dispatch(subject: str, raw: bytes, fn: Handler, model: type[BaseModel] | None = None) -> dict[str, Any]:
    """Validate, parse, run, dump, validate, wrap. Pure apart from the handler: unit-testable without a broker."""
    try:
        payload = decode_request(raw)
        contracts.validate(contracts.subject_contract(subject, "request"), payload)
        result = await fn(model.model_validate(payload) if model is not None else payload)
        if isinstance(result, BaseModel):
            result = dump(result)
        contracts.validate(contracts.subject_contract(subject, "reply"), result)
        return {"result": result}
    except Exception as exc:  # noqa: BLE001 — every failure becomes a typed reply, never a crash of the subscriber
        return error_reply(subject, exc)


def error_reply(subject: str, exc: Exception) -> dict[str, Any]:
    """The wire reply for a failed request: a ``ServiceError``'s typed payload, anything else ``internal``
    (logged with its traceback). For subscribers outside ``@rpc`` that run their own decode (truncation)."""
    if isinstance(exc, ServiceError):
        if exc.code == "invalid-payload":
            log.warning("rejected", subject=subject, error=exc.message)
        else:
            log.info("error-reply", subject=subject, code=exc.code, error=exc.message)
        return {"error": exc.to_payload()}
    log.error("handler-crashed", subject=subject, exc_info=exc)
    return {"error": {"code": "internal", "message": f"{type(exc).__name__}: {exc}"[:500], "retryable": False}}


class OnLoop(CustomField):
    """A FastStream context parameter (``Context("message")``) resolved on the event loop. fast_depends awaits an
    async ``use`` of a custom field in place and runs a synchronous one — FastStream's ``Context`` — on a worker
    thread: a thread hop per request, which queues behind every other use of the thread pool. Only public API:
    fast_depends' documented ``CustomField`` extension point wrapping ``faststream.Context``. The parameter stays
    a context parameter for FastStream (no payload schema), so the generated AsyncAPI document is unchanged."""

    def __init__(self, name: str) -> None:
        self.context = Context(name)
        super().__init__(cast=self.context.cast, required=self.context.required)

    def set_param_name(self, name: str) -> OnLoop:
        self.context.set_param_name(name)
        return super().set_param_name(name)

    async def use(self, /, **kwargs: Any) -> dict[str, Any]:
        return self.context.use(**kwargs)


async def raw_body(message: NatsMessage) -> bytes:
    """Subscriber decoder: the body stays bytes. ``dispatch`` parses it once, after resolving a claim (FastStream's
    default decoder would parse every JSON body a second time, and refuse a claimed message's empty body)."""
    return message.body


REPLY_HEADERS = {"content-type": "application/json"}
HEARTBEAT_HEADER = "Ctx-Heartbeat"  # request: send progress every <seconds> while the handler runs
PROGRESS_HEADER = "Ctx-Progress"  # an empty message to the reply subject: the handler is still running
PROGRESS_HEADERS = {PROGRESS_HEADER: "1"}
MIN_HEARTBEAT_S = 0.05  # a caller cannot make a replica publish faster than this
LIVENESS_BEATS = 3  # a caller hearing nothing for this many heartbeats counts the responder as gone
STATUS_HEADER = "Status"  # what nats-py makes of a NATS status line (503: no responders)
NO_RESPONDERS_STATUS = "503"


def heartbeat_interval(headers: Mapping[str, str] | None) -> float | None:
    """The progress interval a request asks for (``Ctx-Heartbeat``), or None (no header, or not a positive
    number)."""
    value = headers.get(HEARTBEAT_HEADER) if headers else None
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return max(seconds, MIN_HEARTBEAT_S) if seconds > 0 and math.isfinite(seconds) else None


async def _beat(connection: Client, reply: str, every: float) -> None:
    """Progress messages to ``reply`` until cancelled."""
    while True:
        await asyncio.sleep(every)
        try:
            await connection.publish(reply, b"", headers=PROGRESS_HEADERS)
        except Exception as exc:  # noqa: BLE001 - the connection is going: the caller stops hearing, as it should
            log.info("heartbeat-not-sent", error=f"{type(exc).__name__}: {exc}"[:200])
            return


class LeanServer:
    """Serves one ``@rpc`` subject on a plain nats-py queue subscription: per request a CONSUMER span (the
    caller's trace context continued), the claim check, :func:`dispatch`, and the reply published with the span's
    context — without FastStream's per-message pipeline (dependency injection, its middlewares, a task group),
    which cost more than the handler of a small request.

    At most ``max_workers`` requests of the subscription are handled at once (the subscription's delivery waits
    for a free slot, as FastStream's ``max_workers`` does). :meth:`stop` drains: no new requests, the ones
    delivered are handled and the in-flight ones finish (within the graceful timeout).

    Started and stopped with the broker's connection by :func:`start_servers` / :func:`stop_servers` (the service
    runner does both); the subject's FastStream declaration lives on :func:`declarations`."""

    def __init__(self, subject: str, queue: str, max_workers: int, run: Callable[[bytes], Awaitable[bytes]]) -> None:
        self.subject, self.queue, self.run = subject, queue, run
        self.max_workers = max(1, max_workers)
        self.connection: Client | None = None
        self.subscription: Subscription | None = None
        self._slots: asyncio.Semaphore | None = None
        self._inflight: set[asyncio.Task] = set()
        # requests asking for heartbeats that wait for a slot, beating meanwhile (at most max_workers of them)
        self._waiting: deque[tuple[Msg, float, asyncio.Task]] = deque()

    async def start(self, connection: Client) -> None:
        if self.subscription is not None:
            return
        self.connection = connection
        self._slots = asyncio.Semaphore(self.max_workers)
        self.subscription = await connection.subscribe(self.subject, queue=self.queue, cb=self._deliver)

    async def _deliver(self, msg: Msg) -> None:
        assert self._slots is not None and self.connection is not None
        every = heartbeat_interval(msg.headers) if msg.reply else None
        if every is not None and self._slots.locked() and len(self._waiting) < self.max_workers:
            # its caller listens for progress: it hears it while the request waits for a slot (silence would make
            # it give up on a live replica, and the request run later for nobody); it takes the next free slot
            beat = asyncio.get_running_loop().create_task(_beat(self.connection, msg.reply, every))
            self._waiting.append((msg, every, beat))
            return
        await self._slots.acquire()  # the subscription's next delivery waits for a free slot
        self._start(msg, every)

    def _start(self, msg: Msg, every: float | None) -> None:
        task = asyncio.get_running_loop().create_task(self._serve(msg, every))
        self._inflight.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self._inflight.discard(task)
        if self._waiting:  # the slot passes to the request that has waited longest, beating
            msg, every, beat = self._waiting.popleft()
            beat.cancel()  # _serve beats from here on
            self._start(msg, every)
            return
        assert self._slots is not None
        self._slots.release()

    async def _serve(self, msg: Msg, every: float | None) -> None:
        """Handle one request and reply; ``every``: the progress interval its caller asked for (None: no beats)."""
        span, ctx = consume_span(self.subject, msg.headers)
        token = otel_context.attach(ctx)
        try:
            connection = self.connection
            assert connection is not None
            beating = None if every is None else asyncio.get_running_loop().create_task(
                _beat(connection, msg.reply, every))
            try:
                reply = await claims.answer_raw(claims.store(connection), msg.data, msg.headers, self.subject,
                                                self.run)
            except Exception as exc:  # noqa: BLE001 - a reply that cannot be built is still an answer
                reply = claims.encode_json(error_reply(self.subject, exc))
            finally:
                if beating is not None:  # stopped (not just told to) before the reply: the reply is the last message
                    beating.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await beating
            if msg.reply:
                headers = dict(REPLY_HEADERS)
                inject_into(headers, span)
                try:
                    await connection.publish(msg.reply, reply, headers=headers)
                except MaxPayloadError as exc:  # only a claim form could be this large: answer why
                    log.error("reply-too-large", subject=self.subject, size=len(reply), error=str(exc)[:200])
                    await connection.publish(
                        msg.reply, claims.encode_json(error_reply(self.subject, exc)), headers=headers)
        except Exception as exc:  # noqa: BLE001 - the connection went away mid-reply: the caller times out
            span.record_exception(exc)
            span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
            log.warning("reply-not-sent", subject=self.subject, error=f"{type(exc).__name__}: {exc}"[:300])
        finally:
            otel_context.detach(token)
            span.end()

    async def stop(self, graceful_timeout: float | None) -> None:
        """Drain: no new requests; the delivered ones are handled; wait for the in-flight ones, at most
        ``graceful_timeout``. Without a graceful timeout (as FastStream without one) it only unsubscribes."""
        sub, self.subscription = self.subscription, None
        if graceful_timeout is None:
            if sub is not None:
                with contextlib.suppress(Exception):  # a closed connection has no subscription left anyway
                    await sub.unsubscribe()
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + graceful_timeout
        if sub is not None:
            try:
                await asyncio.wait_for(sub.drain(), max(0.0, deadline - loop.time()))
            except Exception as exc:  # noqa: BLE001 - closed connection or timeout: nothing more will arrive
                log.info("subscription-not-drained", subject=self.subject, error=f"{type(exc).__name__}: {exc}")
        # the in-flight handlers, and the waiting requests each slot they free passes to
        while self._inflight and loop.time() < deadline:
            await asyncio.wait(set(self._inflight), timeout=max(0.0, deadline - loop.time()),
                               return_when=asyncio.FIRST_COMPLETED)
        if self._inflight or self._waiting:
            log.warning("drain-timeout", subject=self.subject, in_flight=len(self._inflight),
                        waiting=len(self._waiting))
            while self._waiting:  # never started: their callers stop hearing progress and go elsewhere
                self._waiting.popleft()[2].cancel()


@dataclass
class _Served:
    """What ``@rpc`` registered for one runtime broker."""

    declarations: NatsBroker
    servers: list[LeanServer] = field(default_factory=list)


# keyed by the runtime broker, so registering needs nothing of the broker but its identity
_served: weakref.WeakKeyDictionary[NatsBroker, _Served] = weakref.WeakKeyDictionary()


def _registered(broker: NatsBroker) -> _Served:
    served = _served.get(broker)
    if served is None:
        spec = broker.specification  # same server entry in the AsyncAPI document as the runtime broker
        served = _served[broker] = _Served(NatsBroker(
            specification_url=spec.url, protocol=spec.protocol, protocol_version=spec.protocol_version,
            description=spec.description, tags=spec.tags, security=spec.security, logger=None))
    return served


def declarations(broker: NatsBroker) -> NatsBroker:
    """The never-connected broker holding a FastStream subscriber per ``@rpc`` subject of ``broker``: the
    subject's declaration (title, description, handler) for the AsyncAPI document and FastStream's in-memory
    test broker. Its subscribers never take a message from a real connection: :class:`LeanServer` does."""
    return _registered(broker).declarations


def servers(broker: NatsBroker) -> tuple[LeanServer, ...]:
    return tuple(_served[broker].servers) if broker in _served else ()


async def start_servers(broker: NatsBroker) -> None:
    """Subscribe every ``@rpc`` subject of ``broker`` on its (connected) nats-py connection, and return only once
    the server has the subscriptions: nats-py sends SUB with its next flush, and a request published by another
    connection before then would find no responders."""
    started = servers(broker)
    for server in started:
        await server.start(broker.connection)
    if started:
        await broker.connection.flush()


async def stop_servers(broker: NatsBroker, graceful_timeout: float | None) -> None:
    """Drain every ``@rpc`` subject of ``broker`` at once (see :meth:`LeanServer.stop`); before the broker
    closes its connection, so the in-flight replies still go out."""
    await asyncio.gather(*(server.stop(graceful_timeout) for server in servers(broker)))


def rpc(broker: NatsBroker, subject: str, *, queue: str, max_workers: int = 16,
        description: str | None = None) -> Callable[[Handler], Handler]:
    """Serve ``subject`` with a typed handler: a :class:`LeanServer` for ``broker`` (started by
    :func:`start_servers`) and the subject's declaration on :func:`declarations` ``(broker)``."""
    def deco(fn: Handler) -> Handler:
        model = request_model(subject, fn)
        served = _registered(broker)
        declared_on = served.declarations

        async def run(raw: bytes) -> bytes:
            return claims.encode_json(await dispatch(subject, raw, fn, model))

        async def handler(message: Annotated[NatsMessage, OnLoop("message")]) -> bytes:
            return await claims.answer(declared_on, message, run)

        handler.__name__ = fn.__name__
        handler.__doc__ = fn.__doc__
        subscriber = declared_on.subscriber(subject, queue=queue, max_workers=max_workers, decoder=raw_body,
                                            title=subject, description=description or fn.__doc__)
        subscriber(handler)
        served.servers.append(LeanServer(subject, queue, max_workers, run))
        return fn

    return deco


class RpcClient:
    """Calls other services' subjects through a connected FastStream NATS broker."""

    def __init__(self, broker: NatsBroker, default_timeout: float = 10.0) -> None:
        self.broker = broker
        self.default_timeout = default_timeout

    async def call(self, subject: str, payload: dict[str, Any], timeout: float | None = None,
                   heartbeat_s: float | None = None) -> dict[str, Any]:
        """The reply's result. ``heartbeat_s``: the server sends progress this often while the handler runs, and
        ``LIVENESS_BEATS`` of them missed is ``unavailable`` (a dead replica costs seconds, not the timeout)."""
        try:
            store = claims.store_for(self.broker)
            body = claims.encode_json(payload)
            try:
                msg = await self._send(store, subject, body, timeout, heartbeat_s,
                                       claim=len(body) > store.inline_limit())
            except MaxPayloadError:  # inline but over the limit once headers count: send it by claim instead
                msg = await self._send(store, subject, body, timeout, heartbeat_s, claim=True)
            reply = await store.open_reply(msg.data)
        except RemoteError:
            raise
        except ServiceError as exc:  # the claim store (unavailable, claim-missing...) or an undecodable reply
            raise RemoteError(subject, exc.code, exc.message, exc.retryable, exc.details) from exc
        if "error" in reply:
            e = reply["error"]
            raise RemoteError(subject, e.get("code", "internal"), e.get("message", ""), bool(e.get("retryable")),
                              e.get("details"))
        return reply["result"]

    async def _send(self, store: claims.ClaimStore, subject: str, body: bytes, timeout: float | None,
                    heartbeat_s: float | None, *, claim: bool) -> Msg:
        """One request on the broker's connection (nats-py directly: FastStream's publish pipeline cost more than
        the round trip), in a PRODUCER span whose context travels in the headers."""
        headers = {"content-type": "application/json"}
        sent: claims.Claim | None = None
        if claim:
            sent = await store.put(body)
            body, headers = b"", claims.claim_headers(sent)
        timeout = timeout or self.default_timeout
        try:
            with publish_span(subject, headers):
                if heartbeat_s is None:
                    return await self.broker.connection.request(subject, body, timeout=timeout, headers=headers)
                return await self._request_beating(subject, body, headers, timeout, heartbeat_s)
        except NoRespondersError as exc:
            if sent is not None:  # nobody will read it
                await store.delete(sent)
            raise RemoteError(subject, "unavailable", "no responders", True) from exc
        except (NatsTimeout, TimeoutError) as exc:
            raise RemoteError(subject, "timeout", "request timed out", True) from exc
        except MaxPayloadError as exc:
            if not claim:
                raise
            raise PayloadTooLarge(f"even the claim form of the request exceeds max_payload: {exc}") from exc

    async def _request_beating(self, subject: str, body: bytes, headers: dict[str, str], timeout: float,
                               heartbeat_s: float) -> Msg:
        """A request asking for heartbeats, answered on an inbox of its own (nats-py's ``request`` resolves on the
        first message, a progress message here): progress moves the liveness deadline on; silence past it is
        ``unavailable``, the overall ``timeout`` a timeout as without heartbeats."""
        nc = self.broker.connection
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        liveness = LIVENESS_BEATS * heartbeat_s
        sub = await nc.subscribe(nc.new_inbox())  # sent before the request on the same connection: no reply is lost
        try:
            await nc.publish(subject, body, reply=sub.subject,
                             headers={**headers, HEARTBEAT_HEADER: f"{heartbeat_s:g}"})
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    raise NatsTimeout
                try:
                    msg = await sub.next_msg(timeout=min(left, liveness))
                except NatsTimeout:
                    if liveness < left:
                        raise RemoteError(subject, "unavailable", f"the responder went silent (no progress for "
                                          f"{liveness:g} s): it died with the request, or it never started it",
                                          True) from None
                    raise
                status = msg.headers.get(STATUS_HEADER) if msg.headers else None
                if status == NO_RESPONDERS_STATUS:
                    raise NoRespondersError
                if msg.headers and PROGRESS_HEADER in msg.headers:
                    continue
                return msg
        finally:
            with contextlib.suppress(Exception):  # a closed connection has no subscription left anyway
                await sub.unsubscribe()
