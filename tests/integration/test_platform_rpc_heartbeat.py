"""Heartbeats of long request/reply calls on a real NATS server (``RpcClient.call(..., heartbeat_s=…)`` against a
``LeanServer``): progress messages while the handler runs, the final reply last; a caller that hears nothing for
the liveness window (a dead or silent responder, a request waiting past the bound of a busy replica) gets a retryable
``unavailable`` long before its timeout; no responders, the timeout and the claim check as without heartbeats."""

from __future__ import annotations

import asyncio
import json

import httpx
import nats
import pytest
import pytest_asyncio
from ctxbuild_platform.errors import RemoteError
from ctxbuild_platform.rpc import HEARTBEAT_HEADER, PROGRESS_HEADER, rpc, start_servers, stop_servers
from faststream.nats import NatsBroker

from tests.integration.test_platform_rpc_lean import Gate
from tests.support.extra_contracts import with_subject

pytestmark = pytest.mark.integration

SUBJECT = "ctx.test.heartbeat.work"
QUEUE = "heartbeat-test"
# seconds between progress messages the tests ask for; the liveness window (3 of them) is wide enough for a
# stalled event loop on a busy machine (the servers run in the test's own process)
BEAT = 0.5


@pytest.fixture(scope="module")
def test_contracts(tmp_path_factory):
    """The real contracts plus a subject of our own, loaded for this process only."""
    yield from with_subject(tmp_path_factory, SUBJECT, {
        "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object", "required": ["n"],
        "properties": {"n": {"type": "integer"}, "data": {"type": "string"}}, "additionalProperties": False})


class Servers:
    """``@rpc`` servers of SUBJECT, each on its own broker (as replicas are); up once the NATS server lists their
    queue subscription, gone once it no longer does (as in test_platform_rpc_lean)."""

    def __init__(self, stack) -> None:
        self.url, self.monitor = stack.env["CTX_NATS_URL"], stack.env["CTX_NATS_MONITOR_URL"]
        self.brokers: list[NatsBroker] = []

    async def add(self, handler, *, max_workers: int = 4) -> NatsBroker:
        broker = NatsBroker(self.url, logger=None)
        rpc(broker, SUBJECT, queue=QUEUE, max_workers=max_workers)(handler)
        await broker.start()
        await start_servers(broker)
        self.brokers.append(broker)
        await self.listed(broker.connection.client_id, present=True)
        return broker

    async def listed(self, cid: int, *, present: bool) -> None:
        await listed(self.monitor, cid, present=present)

    async def close(self) -> None:
        for broker in self.brokers:
            cid = broker.connection.client_id
            await stop_servers(broker, 10.0)
            await broker.stop()
            await self.listed(cid, present=False)


async def listed(monitor: str, cid: int, *, present: bool, timeout: float = 10.0) -> None:
    """Until the NATS server lists (or no longer lists) connection ``cid``'s queue subscription of SUBJECT."""
    deadline = asyncio.get_running_loop().time() + timeout
    async with httpx.AsyncClient(base_url=monitor, timeout=5) as http:
        while True:
            subs = (await http.get("/subsz", params={"subs": 1, "test": SUBJECT})).json()
            if present == any(s.get("cid") == cid and s.get("qgroup") == QUEUE
                              for s in subs.get("subscriptions_list") or []):
                return
            assert asyncio.get_running_loop().time() < deadline, \
                f"the NATS server still {'does not list' if present else 'lists'} connection {cid} on {SUBJECT}"
            await asyncio.sleep(0.02)


@pytest_asyncio.fixture(loop_scope="session")
async def servers(stack, test_contracts):
    s = Servers(stack)
    yield s
    await s.close()


async def inboxes(monitor: str, cid: int) -> list[str]:
    """The single-use inboxes connection ``cid`` is subscribed to (not nats-py's request mux ``_INBOX.x.*``)."""
    async with httpx.AsyncClient(base_url=monitor, timeout=5) as http:
        conns = (await http.get("/connz", params={"cid": cid, "subs": 1})).json()["connections"]
    return [s for c in conns for s in c.get("subscriptions_list") or []
            if s.startswith("_INBOX.") and not s.endswith(".*")]


async def no_inbox_left(stack, nats_broker) -> None:
    """Until the caller's connection holds no single-use inbox at the NATS server (the call unsubscribed it)."""
    cid = nats_broker.connection.client_id
    for _ in range(500):
        if not await inboxes(stack.env["CTX_NATS_MONITOR_URL"], cid):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"connection {cid} still holds {await inboxes(stack.env['CTX_NATS_MONITOR_URL'], cid)}")


async def test_a_slow_handler_with_heartbeats_answers_normally(servers, rpc, stack, nats_broker):
    gate = Gate()
    await servers.add(gate.handle)
    call = asyncio.create_task(rpc.call(SUBJECT, {"n": 5}, timeout=60, heartbeat_s=BEAT))
    await asyncio.wait_for(gate.entered.wait(), 10)
    await asyncio.sleep(6 * BEAT)  # twice the liveness window: only the progress messages keep the call alive
    assert not call.done()
    gate.release.set()
    assert await asyncio.wait_for(call, 10) == {"n": 5}
    await no_inbox_left(stack, nats_broker)


async def test_progress_messages_come_while_the_handler_runs_and_the_reply_comes_last(servers, stack):
    gate = Gate()
    await servers.add(gate.handle)
    nc = await nats.connect(stack.env["CTX_NATS_URL"])
    try:
        sub = await nc.subscribe(inbox := nc.new_inbox())
        await nc.publish(SUBJECT, json.dumps({"n": 1}).encode(), reply=inbox, headers={HEARTBEAT_HEADER: str(BEAT)})
        beats = [await sub.next_msg(timeout=10) for _ in range(3)]
        assert all(m.data == b"" and m.headers.get(PROGRESS_HEADER) == "1" for m in beats)
        gate.release.set()
        while (msg := await sub.next_msg(timeout=10)).headers.get(PROGRESS_HEADER):
            pass  # a beat published before the handler returned
        assert json.loads(msg.data) == {"result": {"n": 1}}
        # a request answered after it by the same server: a beat after the reply would be in the inbox by now
        sub2 = await nc.subscribe(inbox2 := nc.new_inbox())
        await nc.publish(SUBJECT, json.dumps({"n": 2}).encode(), reply=inbox2)
        assert json.loads((await sub2.next_msg(timeout=10)).data) == {"result": {"n": 2}}
        await nc.flush()
        assert sub.pending_msgs == 0
    finally:
        await nc.close()


async def test_a_silent_responder_is_unavailable_long_before_the_timeout(rpc, stack, nats_broker):
    """A replica that took the request and died: a plain subscription that reads it and never answers."""
    nc = await nats.connect(stack.env["CTX_NATS_URL"])
    try:
        taken = await nc.subscribe(SUBJECT, queue=QUEUE)
        await nc.flush()
        await listed(stack.env["CTX_NATS_MONITOR_URL"], nc.client_id, present=True)
        with pytest.raises(RemoteError) as silent:
            await rpc.call(SUBJECT, {"n": 1}, timeout=600, heartbeat_s=BEAT)
        await taken.next_msg(timeout=10)  # it did reach the silent responder
    finally:
        await nc.close()
        await listed(stack.env["CTX_NATS_MONITOR_URL"], nc.client_id, present=False)
    # "unavailable", not "timeout": given up on silence (the 600 s timeout would have failed the test run first)
    assert silent.value.code == "unavailable" and silent.value.retryable
    assert "silent" in silent.value.remote_message
    await no_inbox_left(stack, nats_broker)


async def one_running_one_waiting(servers, rpc, gate: Gate) -> tuple[asyncio.Task, asyncio.Task]:
    """A replica with one handler slot: the first call runs (held by ``gate``), the second waits for the slot."""
    await servers.add(gate.handle, max_workers=1)
    first = asyncio.create_task(rpc.call(SUBJECT, {"n": 1}, timeout=60, heartbeat_s=BEAT))
    await asyncio.wait_for(gate.entered.wait(), 10)
    second = asyncio.create_task(rpc.call(SUBJECT, {"n": 2}, timeout=60, heartbeat_s=BEAT))
    return first, second


async def test_a_request_waiting_for_a_handler_slot_hears_progress_and_is_served(servers, rpc):
    """A busy replica (every ``max_workers`` slot taken) beats for a request waiting for a slot: its caller stays
    (it would otherwise give up on a live replica, and the request run later for nobody), and it takes the next
    free slot."""
    gate = Gate()
    try:
        first, second = await one_running_one_waiting(servers, rpc, gate)
        await asyncio.sleep(6 * BEAT)  # twice the liveness window
        assert not second.done() and gate.running == 1  # waiting, heard, not yet run
    finally:
        gate.release.set()
    assert await asyncio.wait_for(first, 10) == {"n": 1}
    assert await asyncio.wait_for(second, 10) == {"n": 2}
    assert gate.most == 1  # the slot bound holds


async def test_past_max_workers_waiting_a_request_is_unheard_and_given_up(servers, rpc):
    """The bound: ``max_workers`` requests wait beating; one more waits unheard, like any request on a busy
    replica, and its caller gives up after the liveness window."""
    gate = Gate()
    try:
        first, second = await one_running_one_waiting(servers, rpc, gate)
        await asyncio.sleep(BEAT)  # the second is waiting (beating) before the third arrives
        with pytest.raises(RemoteError) as third:
            await rpc.call(SUBJECT, {"n": 3}, timeout=600, heartbeat_s=BEAT)
        assert third.value.code == "unavailable" and "silent" in third.value.remote_message
        assert not first.done() and not second.done()
    finally:
        gate.release.set()
    assert await asyncio.wait_for(first, 10) == {"n": 1}
    assert await asyncio.wait_for(second, 10) == {"n": 2}


async def test_no_responders_is_unavailable_as_without_heartbeats(rpc, stack, nats_broker):
    with pytest.raises(RemoteError) as nobody:
        await rpc.call("ctx.test.heartbeat.nobody", {"n": 1}, timeout=60, heartbeat_s=BEAT)
    assert (nobody.value.code, nobody.value.remote_message, nobody.value.retryable) == \
        ("unavailable", "no responders", True)
    await no_inbox_left(stack, nats_broker)


async def test_the_timeout_still_applies(servers, rpc, stack, nats_broker):
    gate = Gate()
    await servers.add(gate.handle)
    try:
        with pytest.raises(RemoteError) as late:
            await rpc.call(SUBJECT, {"n": 1}, timeout=10 * BEAT, heartbeat_s=BEAT)
    finally:
        gate.release.set()
    assert late.value.code == "timeout" and late.value.retryable
    await no_inbox_left(stack, nats_broker)


async def test_a_large_request_and_reply_travel_by_claim_with_heartbeats(servers, rpc):
    async def echo(payload):
        await asyncio.sleep(4 * BEAT)  # past the liveness window: the beats carry it
        return {"n": payload["n"], "data": payload["data"] * 2}

    await servers.add(echo)
    data = "0123456789abcdef" * (64 * 1024)  # 1 MiB: over the inline limit both ways
    reply = await rpc.call(SUBJECT, {"n": 3, "data": data}, timeout=60, heartbeat_s=BEAT)
    assert reply == {"n": 3, "data": data * 2}
