"""The ``@rpc`` server path on a real NATS server (``ctxbuild_platform.rpc.LeanServer``, started and stopped with
``start_servers`` / ``stop_servers`` as the service runner does): one plain nats-py queue subscription per subject
(each request answered once, replicas in the queue group share the load); at most ``max_workers`` run at once; a
stop drains (the in-flight request is answered, then nobody listens); the caller's trace continues into the
handler and back into the reply's headers."""

from __future__ import annotations

import asyncio
import json

import httpx
import nats
import pytest
import pytest_asyncio
from ctxbuild_platform.errors import RemoteError
from ctxbuild_platform.rpc import RpcClient, declarations, rpc, start_servers, stop_servers
from ctxbuild_platform.telemetry import add_span_processor, configure_tracing
from faststream.nats import NatsBroker
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.support.extra_contracts import with_subject

pytestmark = pytest.mark.integration

SUBJECT = "ctx.test.lean.work"


@pytest.fixture(scope="module")
def test_contracts(tmp_path_factory):
    """The real contracts plus a subject of our own, loaded for this process only."""
    yield from with_subject(tmp_path_factory, SUBJECT, {
        "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object", "required": ["n"],
        "properties": {"n": {"type": "integer"}, "traceparent": {"type": "string"}}, "additionalProperties": False})


class Gate:
    """A handler that holds every request until released, counting how many it holds at once."""

    def __init__(self) -> None:
        self.running = 0
        self.most = 0
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def handle(self, payload):
        self.running += 1
        self.most = max(self.most, self.running)
        self.entered.set()
        try:
            await self.release.wait()
        finally:
            self.running -= 1
        return {"n": payload["n"]}


class Servers:
    """``@rpc`` servers of SUBJECT, each on its own broker (as replicas are), stopped as the service runner does."""

    def __init__(self, stack, graceful_timeout: float | None = 10.0) -> None:
        self.url, self.graceful_timeout = stack.env["CTX_NATS_URL"], graceful_timeout
        self.monitor = stack.env["CTX_NATS_MONITOR_URL"]
        self.brokers: list[NatsBroker] = []

    async def add(self, handler, *, max_workers: int) -> NatsBroker:
        broker = NatsBroker(self.url, logger=None)
        rpc(broker, SUBJECT, queue="lean-test", max_workers=max_workers)(handler)
        await broker.start()
        await start_servers(broker)
        self.brokers.append(broker)
        await self.listed(broker.connection.client_id, present=True)
        return broker

    async def listed(self, cid: int, *, present: bool, timeout: float = 10.0) -> None:
        """Until the NATS server lists (or no longer lists) connection ``cid``'s queue subscription of SUBJECT, by
        its monitoring endpoint. ``start_servers`` flushes after subscribing, which should be enough, yet a CI run
        once saw no responders right after it — maybe a closed server of an earlier test still listed and picked —
        so the tests wait for the server's own word both ways."""
        deadline = asyncio.get_running_loop().time() + timeout
        async with httpx.AsyncClient(base_url=self.monitor, timeout=5) as http:
            while True:
                subs = (await http.get("/subsz", params={"subs": 1, "test": SUBJECT})).json()
                if present == any(s.get("cid") == cid and s.get("qgroup") == "lean-test"
                                  for s in subs.get("subscriptions_list") or []):
                    return
                assert asyncio.get_running_loop().time() < deadline, \
                    f"the NATS server still {'does not list' if present else 'lists'} connection {cid} on {SUBJECT}"
                await asyncio.sleep(0.02)

    async def stop(self, broker: NatsBroker) -> None:
        cid = broker.connection.client_id
        await stop_servers(broker, self.graceful_timeout)
        await broker.stop()
        await self.listed(cid, present=False)  # gone at the server too, before another test sends requests

    async def close(self) -> None:
        for broker in self.brokers:
            await self.stop(broker)


@pytest_asyncio.fixture(loop_scope="session")
async def servers(stack, test_contracts):
    s = Servers(stack)
    yield s
    await s.close()


async def test_requests_are_served_by_the_lean_subscription_at_most_max_workers_at_once(servers, rpc):
    gate = Gate()
    broker = await servers.add(gate.handle, max_workers=3)
    # FastStream subscribes nothing: the subject's declaration lives on a broker that never connects
    assert broker.subscribers == [] and len(declarations(broker).subscribers) == 1
    calls = [asyncio.create_task(rpc.call(SUBJECT, {"n": i})) for i in range(8)]
    try:
        await asyncio.wait_for(gate.entered.wait(), 10)
        await asyncio.sleep(0.3)  # every request has reached the server by now
        assert gate.running == 3
    finally:
        gate.release.set()
    replies = await asyncio.gather(*calls)
    assert sorted(r["n"] for r in replies) == list(range(8))
    assert gate.most == 3


async def test_each_request_is_answered_once(servers, stack):
    calls: list[int] = []

    async def handler(payload):
        calls.append(payload["n"])
        return {"n": payload["n"]}

    await servers.add(handler, max_workers=4)
    nc = await nats.connect(stack.env["CTX_NATS_URL"])
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        for n in range(5):
            await nc.publish(SUBJECT, json.dumps({"n": n}).encode(), reply=inbox)
        replies = [json.loads((await sub.next_msg(timeout=10)).data) for _ in range(5)]
        # a request sent after the five has been answered: a second answer to any of them would be here by now
        sub2 = await nc.subscribe(inbox2 := nc.new_inbox())
        await nc.publish(SUBJECT, json.dumps({"n": 99}).encode(), reply=inbox2)
        await sub2.next_msg(timeout=10)
        await nc.flush()
        assert sub.pending_msgs == 0
    finally:
        await nc.close()
    assert sorted(r["result"]["n"] for r in replies) == list(range(5))
    assert sorted(calls) == [0, 1, 2, 3, 4, 99]


async def test_two_servers_in_the_queue_group_share_the_requests(servers, rpc):
    seen: dict[str, list[int]] = {"a": [], "b": []}

    def handler_of(name: str):
        async def handle(payload):
            seen[name].append(payload["n"])
            return {"n": payload["n"]}
        return handle

    await servers.add(handler_of("a"), max_workers=4)
    await servers.add(handler_of("b"), max_workers=4)
    replies = await asyncio.gather(*(rpc.call(SUBJECT, {"n": i}) for i in range(40)))
    assert sorted(r["n"] for r in replies) == list(range(40))
    assert sorted(seen["a"] + seen["b"]) == list(range(40))  # each request handled by exactly one of them
    assert seen["a"] and seen["b"]  # NATS picks at random per request: all 40 on one server has odds 2**-39


async def test_stop_answers_the_in_flight_request_then_nobody_listens(stack, test_contracts, rpc):
    gate = Gate()
    servers = Servers(stack)
    broker = await servers.add(gate.handle, max_workers=4)
    call = asyncio.create_task(rpc.call(SUBJECT, {"n": 7}))
    try:
        await asyncio.wait_for(gate.entered.wait(), 10)
    except BaseException:
        gate.release.set()
        await servers.stop(broker)  # a server left behind would answer the next test's requests
        raise
    stopping = asyncio.create_task(servers.stop(broker))
    await asyncio.sleep(0.2)
    assert not stopping.done()  # the stop waits for the handler
    gate.release.set()
    assert await asyncio.wait_for(call, 10) == {"n": 7}
    await asyncio.wait_for(stopping, 10)
    with pytest.raises(RemoteError) as gone:
        await rpc.call(SUBJECT, {"n": 8}, timeout=2)
    assert gone.value.code == "unavailable" and gone.value.retryable


async def test_without_a_graceful_timeout_stop_does_not_wait_for_handlers(stack, test_contracts, rpc):
    """As FastStream without one: the subscription goes, the stop returns, the caller is not answered."""
    gate = Gate()
    servers = Servers(stack, graceful_timeout=None)
    broker = await servers.add(gate.handle, max_workers=2)
    call = asyncio.create_task(rpc.call(SUBJECT, {"n": 1}, timeout=3))
    try:
        await asyncio.wait_for(gate.entered.wait(), 10)
        await asyncio.wait_for(servers.stop(broker), 5)  # returns although the handler is still held
        assert gate.running == 1
    except BaseException:
        await servers.stop(broker)  # a server left behind would answer the next module's requests
        raise
    finally:
        gate.release.set()
    with pytest.raises(RemoteError) as unanswered:
        await call
    assert unanswered.value.retryable


async def test_the_callers_trace_continues_into_the_handler_and_the_reply(servers, nats_broker):
    spans = InMemorySpanExporter()
    configure_tracing("lean-test")
    add_span_processor(SimpleSpanProcessor(spans))
    seen: dict[str, str] = {}

    async def handler(payload):
        ctx = trace.get_current_span().get_span_context()
        seen["trace"], seen["span"] = format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")
        return {"n": payload["n"]}

    await servers.add(handler, max_workers=2)
    with trace.get_tracer("test").start_as_current_span("caller") as caller:
        assert await RpcClient(nats_broker).call(SUBJECT, {"n": 1}) == {"n": 1}
    tid = caller.get_span_context().trace_id
    ours = [s for s in spans.get_finished_spans() if s.context.trace_id == tid]
    by_name = {s.name: s for s in ours}
    publish, process = by_name[f"{SUBJECT} publish"], by_name[f"{SUBJECT} process"]
    assert publish.parent.span_id == caller.get_span_context().span_id
    assert process.parent.span_id == publish.context.span_id
    assert process.kind is trace.SpanKind.CONSUMER and publish.kind is trace.SpanKind.PRODUCER
    # the handler ran inside the consumer span
    assert seen == {"trace": format(tid, "032x"), "span": format(process.context.span_id, "016x")}

