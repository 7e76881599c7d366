"""End-to-end fixtures: the six services as real processes on the session's real stack, plus a NATS tap that
records every payload crossing a ctx.* subject (and the replies to them) for contract checks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import nats
import pytest
import pytest_asyncio
from ctxbuild_devstack import SERVICES, free_port

from tests.support.fake_openai import FakeOpenAI
from tests.support.server import serving
from tests.support.web_pages import PageServer

TRACE_UI_URL = "http://127.0.0.1:16686/trace/{trace_id}"  # the inspector's trace links (no server needed)


@dataclass
class Tap:
    requests: list[tuple[str, bytes, str | None]] = field(default_factory=list)  # subject, data, reply inbox
    replies: dict[str, bytes] = field(default_factory=dict)  # inbox → data
    events: list[tuple[str, bytes]] = field(default_factory=list)  # ctx.evt.<Type> publishes


@pytest.fixture(scope="session")
def fake_openai():
    """A local server speaking the OpenAI chat-completions wire format (the one replaced part: the model)."""
    yield from serving(FakeOpenAI(free_port()))


@pytest.fixture(scope="module")
def page_server():
    """A local web server for the module's ``web_fetch`` pages (register them with ``add``)."""
    yield from serving(PageServer(free_port()))


@pytest.fixture(scope="session")
def all_services(stack, start_service, fake_openai) -> str:
    for name in SERVICES:
        # SSE streams read on wake-ups (ctx.turn.appended/ended); a backstop poll this long makes a missing
        # wake-up show as a stalled stream instead of hiding behind the timer
        extra = {"CTX_OPENAI_BASE_URL": fake_openai.base_url, "CTX_TRACE_UI_URL": TRACE_UI_URL,
                 "CTX_SSE_POLL_S": "20"} if name == "orchestration" else {}
        start_service(name, **extra)
    return stack.env["CTX_ORCHESTRATION_HTTP"]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def tap(stack, all_services) -> AsyncIterator[Tap]:
    """Module-scoped: a wildcard subscriber is interest on every subject, so while it lives a request to a
    stopped service waits for its timeout instead of failing fast with no-responders."""
    nc = await nats.connect(stack.env["CTX_NATS_URL"], name="e2e-tap")
    t = Tap()

    async def on_ctx(msg):
        if msg.subject.startswith("ctx.evt."):
            t.events.append((msg.subject, msg.data))
        else:
            t.requests.append((msg.subject, msg.data, msg.reply or None))

    async def on_inbox(msg):
        t.replies[msg.subject] = msg.data

    await nc.subscribe("ctx.>", cb=on_ctx)
    await nc.subscribe("_INBOX.>", cb=on_inbox)
    await nc.flush()
    yield t
    await asyncio.sleep(0.2)
    await nc.drain()
