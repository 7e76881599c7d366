"""OpenTelemetry tracing. Spans are propagated over NATS headers by :class:`TracingMiddleware` (a broker middleware).

Finding #5: ending a span when no tracer provider is configured must be a no-op, never an exception.
`span()` uses the API's global tracer, which is a no-op tracer until `configure_tracing` installs the SDK.

Spans are recorded only once something takes them (an exporter, or a processor added through
:func:`add_span_processor`): until then every span is a non-recording one that still carries a trace id, so trace
context still propagates over NATS and into events and logs, without the per-span work nobody would read. An
``OTEL_TRACES_SAMPLER`` in the environment is the operator's choice and is used as the SDK reads it, unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from faststream import BaseMiddleware
from faststream.message import SourceType
from faststream.response import PublishType
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, Decision, ParentBased, Sampler, SamplingResult
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_provider: TracerProvider | None = None


class RecordWhenTaken(Sampler):
    """The SDK's default sampler (parent-based, always on) once a span processor takes spans; before that, no span
    is recorded (``DROP``: a non-recording span with a trace id of its own or its parent's). Recording a span
    builds its attributes, ids and timings and runs the processors' hooks; with no processor it is thrown away."""

    def __init__(self) -> None:
        self.taken = False
        self._inner = ParentBased(ALWAYS_ON)

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                      trace_state=None) -> SamplingResult:
        if self.taken:
            return self._inner.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)
        parent = trace.get_current_span(parent_context).get_span_context()
        return SamplingResult(Decision.DROP, trace_state=parent.trace_state if parent.is_valid else None)

    def get_description(self) -> str:
        return f"RecordWhenTaken{{{self._inner.get_description()}}}"


_sampler: RecordWhenTaken | None = None


def configure_tracing(service: str, otlp_endpoint: str | None = None,
                      exporter: SpanExporter | None = None) -> TracerProvider:
    """Install the SDK provider once per process (OTel forbids replacing the global one); spans are recorded from
    the first exporter on (module docstring)."""
    global _provider, _sampler
    if _provider is not None:
        if exporter is not None:
            add_span_processor(BatchSpanProcessor(exporter))
        return _provider
    # the operator's OTEL_TRACES_SAMPLER is read by the SDK itself; otherwise record only once spans are taken
    _sampler = None if os.environ.get("OTEL_TRACES_SAMPLER") else RecordWhenTaken()
    provider = TracerProvider(resource=Resource.create({"service.name": f"ctxbuild-{service}"}), sampler=_sampler)
    trace.set_tracer_provider(provider)
    _provider = provider
    if exporter is None and otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=otlp_endpoint.rstrip("/") + "/v1/traces")
    if exporter is not None:
        add_span_processor(BatchSpanProcessor(exporter))
    return provider


def add_span_processor(processor: SpanProcessor) -> None:
    """Hand this process's spans to ``processor`` (an exporter's, a test's in-memory one) from now on: spans
    started after this call are recorded. Needs :func:`configure_tracing` first."""
    if _provider is None:
        raise RuntimeError("configure_tracing() first")
    _provider.add_span_processor(processor)
    if _sampler is not None:
        _sampler.taken = True


# a proxy until configure_tracing installs the provider, then that provider's tracer (not looked up per span)
_tracer = trace.get_tracer("ctxbuild")


@contextmanager
def span(name: str, **attributes: Any) -> Iterator[trace.Span]:
    """A span on the global tracer; safe with or without a configured provider."""
    with _tracer.start_as_current_span(name) as s:
        for k, v in attributes.items():
            if v is not None:
                s.set_attribute(k, v)
        yield s


def end_span_safely(s: trace.Span | None) -> None:
    """End a span obtained anywhere (maybe a non-recording one) without raising."""
    if s is None:
        return
    try:
        s.end()
    except Exception:  # noqa: BLE001 - tracing must never break a turn
        pass


# ---------------------------------------------------------------------------------------------- NATS propagation
_W3C = TraceContextTextMapPropagator()
_NATS_ATTRS = {"messaging.system": "nats"}
# a proxy until configure_tracing installs the provider, then that provider's tracer
_nats_tracer = trace.get_tracer("ctxbuild.nats")


def consume_span(subject: str, headers: Mapping[str, str] | None) -> tuple[trace.Span, otel_context.Context]:
    """The CONSUMER span (``<subject> process``) of a message taken from NATS without FastStream (the RPC layer's
    own subscriptions), child of the trace context its headers carry, and the context to run its handler in.
    The caller ends the span."""
    parent = _W3C.extract(headers) if headers else otel_context.Context()
    span = _nats_tracer.start_span(f"{subject} process", context=parent, kind=trace.SpanKind.CONSUMER,
                                   attributes={**_NATS_ATTRS, "messaging.destination.name": subject,
                                               "messaging.operation": "process"})
    return span, trace.set_span_in_context(span, parent)


def inject_into(headers: dict[str, str], span: trace.Span) -> None:
    """``span``'s W3C trace context into outgoing headers (a reply carries its request's consumer span)."""
    _W3C.inject(headers, context=trace.set_span_in_context(span))


@contextmanager
def publish_span(subject: str, headers: dict[str, str]) -> Iterator[trace.Span]:
    """A PRODUCER span (``<subject> publish``) around a message sent without FastStream, its context injected
    into ``headers`` — what :class:`TracingMiddleware` does for a message FastStream sends."""
    with _nats_tracer.start_as_current_span(
            f"{subject} publish", kind=trace.SpanKind.PRODUCER,
            attributes={**_NATS_ATTRS, "messaging.destination.name": subject,
                        "messaging.operation": "publish"}) as s:
        _W3C.inject(headers)
        yield s


class TracingMiddleware:
    """FastStream broker middleware: W3C trace context in and out over NATS headers, and one span per message
    consumed (CONSUMER, ``<subject> process``) and per message sent (PRODUCER, ``<subject> publish``; a reply
    carries its request's consumer span instead). That is the tracing FastStream's ``NatsTelemetryMiddleware``
    does, without what it adds per message on top — metrics through the (unconfigured, no-op) meter provider,
    baggage scopes, an extra "create" span, a span for every RPC response received. A factory: FastStream calls it
    once per message."""

    def __init__(self, *, tracer_provider: TracerProvider | None = None) -> None:
        provider = tracer_provider or trace.get_tracer_provider()
        self._tracer = provider.get_tracer("ctxbuild.nats")

    def __call__(self, msg: Any, /, *, context: Any) -> _TracingScope:
        return _TracingScope(msg, context=context, tracer=self._tracer)


class _TracingScope(BaseMiddleware):
    __slots__ = ("_span", "_tracer")

    def __init__(self, msg: Any, /, *, context: Any, tracer: trace.Tracer) -> None:
        super().__init__(msg, context=context)
        self._tracer = tracer
        self._span: trace.Span | None = None  # this message's consumer span (the parent of its reply)

    async def consume_scope(self, call_next: Any, msg: Any) -> Any:
        if msg.source_type is SourceType.RESPONSE:
            return await call_next(msg)  # an RPC reply received: the request's producer span covers it
        raw = msg.raw_message
        if isinstance(raw, list):  # a batch: no single parent
            parent, subject = otel_context.Context(), (getattr(raw[0], "subject", "") if raw else "")
        else:
            parent, subject = _W3C.extract(msg.headers or {}), getattr(raw, "subject", "")
        span = self._tracer.start_span(f"{subject} process", context=parent, kind=trace.SpanKind.CONSUMER,
                                       attributes={**_NATS_ATTRS, "messaging.destination.name": subject,
                                                   "messaging.operation": "process"})
        self._span = span
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        try:
            return await call_next(msg)
        except Exception as exc:
            span.record_exception(exc)
            span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            otel_context.detach(token)
            span.end()

    async def publish_scope(self, call_next: Any, cmd: Any) -> Any:
        if cmd.publish_type is PublishType.REPLY and self._span is not None:
            _W3C.inject(cmd.headers, context=trace.set_span_in_context(self._span))
            return await call_next(cmd)
        with self._tracer.start_as_current_span(
                f"{cmd.destination} publish", kind=trace.SpanKind.PRODUCER,
                attributes={**_NATS_ATTRS, "messaging.destination.name": cmd.destination,
                            "messaging.operation": "publish"}):
            _W3C.inject(cmd.headers)
            return await call_next(cmd)
