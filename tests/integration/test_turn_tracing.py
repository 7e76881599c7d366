"""One trace per turn (SPEC §12, issue #9 item 5): a turn run by the real runner against the real services over
NATS produces turn → step → compaction / provider / tool / truncation spans under one trace id, continues the
trace of the request that queued it, and the services it calls receive that trace in the NATS headers (the event
store records it on every event of the turn)."""

from __future__ import annotations

import uuid

import pytest
from ctxbuild_orchestration.adapters.backends import Backends, new_event
from ctxbuild_orchestration.app.runner import TurnRunner
from ctxbuild_platform.rpc import RpcClient
from ctxbuild_platform.service import broker_options
from ctxbuild_platform.settings import ServiceSettings
from ctxbuild_platform.telemetry import add_span_processor
from ctxbuild_providers import ReplayProvider
from faststream.nats import NatsBroker
from opentelemetry import trace
from opentelemetry.propagate import inject
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def services(stack, start_service):
    for name in ("persistence", "blobstore", "truncation", "compaction"):
        start_service(name)


async def test_a_turn_is_one_trace_across_the_services(stack, services):
    settings = ServiceSettings(service_name="trace-test", nats_url=stack.env["CTX_NATS_URL"])
    opts = broker_options(settings)
    spans = InMemorySpanExporter()
    add_span_processor(SimpleSpanProcessor(spans))  # spans are recorded from here on
    broker = NatsBroker(**opts)
    await broker.connect()
    try:
        backends = Backends(RpcClient(broker, 30.0))
        cid, tid = f"conv_tr_{uuid.uuid4().hex[:8]}", f"turn_tr_{uuid.uuid4().hex[:8]}"
        uid = f"msg_{uuid.uuid4().hex[:8]}"
        await backends.append(f"conversation:{cid}", [new_event("ConversationCreated", {"conversationId": cid,
                                                                                         "settings": {}})], expected=0)
        await backends.append(f"conversation:{cid}", [new_event("UserMessageAdded", {"message": {
            "id": uid, "parentId": None, "role": "user", "parts": [{"type": "text", "text": "go"}]}})])
        big = "\n".join(f"row {i} " + "y" * 60 for i in range(3000))
        script = [{"toolCalls": [{"toolName": "bash", "input": {"command": "cat log"},
                                  "output": {"type": "text", "value": big}}]}, {"text": "done"}]
        with trace.get_tracer("test").start_as_current_span("POST /v1/conversations/{id}/turns") as edge:
            carrier: dict[str, str] = {}
            inject(carrier)  # what the edge stores in TurnQueued
            edge_trace = edge.get_span_context().trace_id
        await backends.append(f"turn:{tid}", [new_event("TurnQueued", {
            "turnId": tid, "conversationId": cid, "userMessageId": uid, "trace": carrier,
            "settings": {"contextWindow": 16000, "mcpMode": "disabled"},
            # the recorded output is larger than an event may be: the script travels beside the event, as the
            # edge's blob reference does (the factory below is what resolves it)
            "provider": {"kind": "replay", "scriptRef": {"sha256": "0" * 64, "size": len(big)},
                         "tools": [{"name": "bash", "description": "run", "inputSchema": {"type": "object"}}]}})],
            expected=0)

        async def make(spec, _cid, _tid):
            return ReplayProvider(script, tools=spec["tools"])

        runner = TurnRunner(backends, make, keep_requests=True)
        assert await runner.run(tid) == "completed"
    finally:
        await broker.stop()

    ours = [s for s in spans.get_finished_spans() if s.context.trace_id == edge_trace]
    names = [s.name for s in ours]
    for expected in ("turn", "step", "compaction.turn_start", "compaction.in_loop", "provider.call", "tool",
                     "truncation.step"):
        assert expected in names, (expected, sorted(set(names)))
    assert names.count("step") == 2 and names.count("provider.call") == 2
    by_id = {s.context.span_id: s for s in ours}
    turn = next(s for s in ours if s.name == "turn")
    for s in ours:  # every runner span hangs under the turn span (step → provider/tool/…)
        if s.name in ("step",):
            assert s.parent.span_id == turn.context.span_id
        if s.name in ("provider.call", "tool", "truncation.step", "compaction.in_loop"):
            assert by_id[s.parent.span_id].name == "step", s.name
    # the calls to the other services went out with this trace (producer spans of the NATS middleware)
    assert any("ctx.truncate.step" in n for n in names) and any("ctx.persist.append" in n for n in names), names
    # …and the services received it: every event of the turn carries the trace in its metadata
    evs = (await backends_read(stack, tid))
    trace_hex = format(edge_trace, "032x")
    assert evs and all(e["metadata"].get("traceparent", "").split("-")[1] == trace_hex for e in evs[1:]), \
        [(e["type"], e["metadata"].get("traceparent")) for e in evs]


async def backends_read(stack, turn_id: str) -> list[dict]:
    broker = NatsBroker(stack.env["CTX_NATS_URL"], logger=None)
    await broker.connect()
    try:
        page = await RpcClient(broker, 30.0).call("ctx.persist.read_stream", {"streamId": f"turn:{turn_id}"})
        return page["events"]
    finally:
        await broker.stop()
