"""Spans are recorded only once something takes them (``ctxbuild_platform.telemetry``): before, every span is a
non-recording one that still carries a trace id — the caller's when a traceparent came in — so trace context still
reaches the next service, the events and the logs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from ctxbuild_platform.telemetry import RecordWhenTaken
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

CALLER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_before_anything_takes_spans_none_is_recorded_yet_the_trace_goes_on():
    sampler = RecordWhenTaken()
    provider = TracerProvider(sampler=sampler, shutdown_on_exit=False)
    spans = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(spans))  # taken only once the sampler is told
    tracer = provider.get_tracer("t")
    parent = TraceContextTextMapPropagator().extract({"traceparent": CALLER, "tracestate": "k=v"})

    with tracer.start_as_current_span("child", context=parent) as child:
        ctx = child.get_span_context()
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)
    assert not child.is_recording()
    assert format(ctx.trace_id, "032x") == CALLER.split("-")[1]  # the caller's trace goes on
    assert ctx.span_id != int(CALLER.split("-")[2], 16) and ctx.is_valid
    assert ctx.trace_state.get("k") == "v"
    assert carrier["traceparent"].split("-")[1] == CALLER.split("-")[1]
    with tracer.start_as_current_span("root") as root:  # no parent: a trace id of its own
        assert root.get_span_context().is_valid
    assert spans.get_finished_spans() == ()

    sampler.taken = True
    with tracer.start_as_current_span("kept", context=parent):
        pass
    assert [s.name for s in spans.get_finished_spans()] == ["kept"]
    assert spans.get_finished_spans()[0].context.trace_id == int(CALLER.split("-")[1], 16)


def test_parent_based_once_taken():
    sampler = RecordWhenTaken()
    sampler.taken = True
    provider = TracerProvider(sampler=sampler, shutdown_on_exit=False)
    tracer = provider.get_tracer("t")
    unsampled = TraceContextTextMapPropagator().extract({"traceparent": CALLER[:-2] + "00"})
    with tracer.start_as_current_span("x", context=unsampled) as x:
        assert not x.is_recording()
    with tracer.start_as_current_span("y") as y:
        assert y.is_recording()
    assert "ParentBased" in sampler.get_description()


PROBE = textwrap.dedent("""
    import json
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from ctxbuild_platform import telemetry

    telemetry.configure_tracing("probe")
    out = {}
    with telemetry.span("before") as s:
        out["before"] = [s.is_recording(), s.get_span_context().is_valid]
    spans = InMemorySpanExporter()
    telemetry.add_span_processor(SimpleSpanProcessor(spans))
    with telemetry.span("after") as s:
        out["after"] = [s.is_recording(), s.get_span_context().is_valid]
    out["exported"] = [s.name for s in spans.get_finished_spans()]
    print(json.dumps(out))
""")


def probe(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                          timeout=60, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_configure_tracing_records_from_the_first_processor_on():
    assert probe() == {"before": [False, True], "after": [True, True], "exported": ["after"]}


def test_an_operators_sampler_from_the_environment_is_used_as_is():
    # always_on: recorded even before any processor (the operator asked for it); always_off: never
    assert probe(OTEL_TRACES_SAMPLER="always_on") == {"before": [True, True], "after": [True, True],
                                                      "exported": ["after"]}
    assert probe(OTEL_TRACES_SAMPLER="always_off")["exported"] == []

