"""OpenTelemetry tracing. Spans are propagated over NATS headers by FastStream's telemetry middleware.

Finding #5: ending a span when no tracer provider is configured must be a no-op, never an exception.
`span()` uses the API's global tracer, which is a no-op tracer until `configure_tracing` installs the SDK.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

_provider: TracerProvider | None = None


def configure_tracing(service: str, otlp_endpoint: str | None = None,
                      exporter: SpanExporter | None = None) -> TracerProvider:
    """Install the SDK provider once per process (OTel forbids replacing the global one)."""
    global _provider
    if _provider is not None:
        if exporter is not None:
            _provider.add_span_processor(BatchSpanProcessor(exporter))
        return _provider
    provider = TracerProvider(resource=Resource.create({"service.name": f"ctxbuild-{service}"}))
    if exporter is None and otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=otlp_endpoint.rstrip("/") + "/v1/traces")
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


@contextmanager
def span(name: str, **attributes: Any) -> Iterator[trace.Span]:
    """A span on the global tracer; safe with or without a configured provider."""
    tracer = trace.get_tracer("ctxbuild")
    with tracer.start_as_current_span(name) as s:
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
