"""`python -m ctxbuild_orchestration`: the HTTP/SSE edge and the turn runner on FastStream's NATS router.

``CTX_ROLE`` splits them for scaling (edge on CPU, runners on work-queue lag); ``all`` (the default, local runs)
serves both from one process.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import structlog
from ctxbuild_platform import contracts
from ctxbuild_platform.deadletter import DeadLetterConfig, DeadLetters
from ctxbuild_platform.errors import InvalidPayload, ServiceError
from ctxbuild_platform.logging import configure_logging
from ctxbuild_platform.rpc import RpcClient
from ctxbuild_platform.service import broker_options, serve
from ctxbuild_providers import AnthropicMessagesProvider, OpenAIChatProvider, Provider, ReplayProvider
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from faststream.nats.fastapi import NatsRouter

from .adapters.backends import Backends
from .adapters.work_queue import ABORT_SUBJECT, Delivery, Heartbeat, QueueConfig, TurnQueue, nak, retry_delay
from .auth import AuthConfig, Authenticator
from .handlers import EdgeLimits, build_api, install_error_handlers
from .runner import TurnRunner, new_id
from .settings import Settings
from .tools import WebTools

log = structlog.get_logger("orchestration")


def check_provider(spec: dict[str, Any], settings: Settings) -> None:
    """Refuse at the edge a turn whose provider this deployment cannot reach (typed, 400)."""
    if spec["kind"] == "anthropic" and settings.anthropic_api_key is None and settings.anthropic_base_url is None:
        raise ServiceError("no Anthropic endpoint configured: set CTX_ANTHROPIC_API_KEY on the orchestration "
                           "service", code="provider-not-configured")
    if spec["kind"] == "openai" and settings.openai_api_key is None and settings.openai_base_url is None:
        raise ServiceError("no OpenAI-compatible endpoint configured: set CTX_OPENAI_BASE_URL and/or "
                           "CTX_OPENAI_API_KEY on the orchestration service", code="provider-not-configured")


def provider_factory(settings: Settings, backends: Backends):
    async def make(spec: dict[str, Any], conversation_id: str, turn_id: str) -> Provider:
        check_provider(spec, settings)
        if spec["kind"] == "replay":
            if "scriptRef" in spec:  # claim check: a large recorded script lives in the blob store
                doc = json.loads(await backends.blobs.get_text(conversation_id, sha256=spec["scriptRef"]["sha256"]))
            else:
                doc = spec
            return ReplayProvider(doc["script"], tools=doc.get("tools") or None,
                                  call_id_prefix=f"call_{turn_id.rsplit('_', 1)[-1][-8:]}")
        if spec["kind"] == "anthropic":
            key = settings.anthropic_api_key.get_secret_value() if settings.anthropic_api_key else None
            return AnthropicMessagesProvider(spec["model"], api_key=key, base_url=settings.anthropic_base_url)
        key = settings.openai_api_key.get_secret_value() if settings.openai_api_key else None
        return OpenAIChatProvider(spec["model"], base_url=settings.openai_base_url, api_key=key)

    return make


class RunnerLoop:
    """Pulls turn commands and runs them; heartbeats while a turn runs; on drain hands unfinished turns back."""

    def __init__(self, queue: TurnQueue, runner: TurnRunner, settings: Settings) -> None:
        self.queue, self.runner, self.settings = queue, runner, settings
        self.stopping = asyncio.Event()
        self.running: dict[str, asyncio.Task] = {}
        self.aborts: dict[str, str] = {}
        # how this replica's last attempts of turns ended (read by a redelivery that followed one); the newest 4096
        self.outcomes: dict[str, str] = {}
        self._loop_task: asyncio.Task | None = None

    def start(self) -> None:
        self._loop_task = asyncio.create_task(
            self.queue.consume(self.handle, self.settings.max_concurrent_turns, self.stopping), name="turn-pull")
        self.queue.health.task = self._loop_task  # /readyz: a consumer whose loop is gone is not ready

    async def handle(self, d: Delivery) -> None:
        current = self.running.get(d.turn_id)
        if current is not None and not current.done():
            await self._follow(d, current)
            return
        task = asyncio.current_task()
        assert task is not None
        self.running[d.turn_id] = task
        try:
            async with Heartbeat(d.msg, self.settings.turn_ack_wait_s):
                outcome = await self.runner.run(d.turn_id, attempt=d.attempt)
            log.info("turn-ended", turn_id=d.turn_id, outcome=outcome, attempt=d.attempt)
            self.outcomes[d.turn_id] = outcome
            while len(self.outcomes) > 4096:
                self.outcomes.pop(next(iter(self.outcomes)))
            await self._settle(d, outcome)
        except asyncio.CancelledError:
            reason = self.aborts.pop(d.turn_id, None)
            if reason is not None:  # an abort: record it, the command is done
                await asyncio.shield(self._abort_recorded(d, reason))
            else:  # drain: hand it back now, another replica resumes from the events
                await asyncio.shield(self._nak(d))
        finally:
            self.running.pop(d.turn_id, None)

    async def _follow(self, d: Delivery, current: asyncio.Task) -> None:
        """A redelivery of a command this replica is still running (its heartbeats were lost for ack_wait, e.g.
        while NATS restarted): no second writer — keep the new delivery alive until the running attempt ends and
        settle it the same way."""
        log.info("turn-redelivered-while-running", turn_id=d.turn_id, attempt=d.attempt)
        async with Heartbeat(d.msg, self.settings.turn_ack_wait_s):
            await asyncio.wait({current})  # not cancelled with this task (a drain cancels the runner's own)
        await self._settle(d, self.outcomes.get(d.turn_id, "unended"))

    async def _settle(self, d: Delivery, outcome: str) -> None:
        if outcome == "unended":  # the terminal event is not stored: never acknowledged before it is
            await nak(d.msg, delay=retry_delay(d.attempt))
        elif outcome == "unknown":  # no TurnQueued: nothing will ever run it — parked, not dropped
            await self.queue.dead_letters.park(d.msg, f"turn-unknown: turn:{d.turn_id} has no TurnQueued",
                                               consumer=self.queue.config.durable)
        elif outcome != "taken-over":
            await d.msg.ack()

    async def _abort_recorded(self, d: Delivery, reason: str) -> None:
        try:
            async with Heartbeat(d.msg, self.settings.turn_ack_wait_s):
                await self.runner.abort_now(d.turn_id, reason)
        except Exception as exc:  # noqa: BLE001 - not recorded: the redelivery reads TurnAbortRequested and ends it
            log.error("abort-not-recorded", turn_id=d.turn_id, error=f"{type(exc).__name__}: {exc}"[:300])
            await nak(d.msg, delay=retry_delay(d.attempt))
            return
        await d.msg.ack()

    async def _nak(self, d: Delivery) -> None:
        await nak(d.msg)

    def abort(self, turn_id: str, reason: str) -> None:
        task = self.running.get(turn_id)
        if task is not None:
            self.aborts[turn_id] = reason
            task.cancel()

    async def drain(self, timeout: float) -> None:
        self.stopping.set()
        if self._loop_task:
            await asyncio.gather(self._loop_task, return_exceptions=True)
        tasks = list(self.running.values())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    configure_logging(settings.service_name, settings.log_level)
    router = NatsRouter(**broker_options(settings))
    broker = router.broker
    rpc = RpcClient(broker, settings.request_timeout_s)
    backends = Backends(rpc, settings.tool_timeout_s)  # the edge: a persistence outage is a 503 at once
    # the runner waits for persistence (a turn must reach its terminal event) and retries truncation elsewhere
    runner_backends = Backends(rpc, settings.tool_timeout_s, patience_s=settings.persist_patience_s,
                               truncate_attempt_s=settings.truncate_attempt_timeout_s,
                               truncate_attempts=settings.truncate_attempts,
                               blob_patience_s=settings.blob_patience_s)
    dead_letters = DeadLetters(lambda: broker.connection, settings.service_name,
                               DeadLetterConfig(stream=settings.dead_letter_stream,
                                                replicas=settings.turns_stream_replicas))
    queue = TurnQueue(lambda: broker.connection, QueueConfig(
        stream=settings.turns_stream, subject=settings.turns_subject, durable=settings.turns_consumer, ack_wait_s=settings.turn_ack_wait_s,
        replicas=settings.turns_stream_replicas, max_deliveries=settings.turn_max_deliveries), dead_letters)
    web = WebTools(settings, mcp_invoke=lambda tool_id, args: backends.invoke(tool_id, args, new_id("call")))
    runner = TurnRunner(runner_backends, provider_factory(settings, runner_backends),
                        default_max_steps=settings.max_steps, keep_requests=settings.keep_served_requests,
                        web_tools=web, terminal_patience_s=settings.terminal_patience_s,
                        compaction_timeout_s=settings.compaction_timeout_s,
                        keep_request_patience_s=settings.keep_request_patience_s)
    loop = RunnerLoop(queue, runner, settings)
    state = {"started": False}
    runs_turns = settings.role in ("all", "runner")

    if runs_turns:
        @router.subscriber(ABORT_SUBJECT)
        async def on_abort(body: dict[str, Any]) -> None:
            # every replica hears it; the one running the turn cancels it (the durable record is the event)
            try:
                contracts.validate("subjects/ctx.turn.abort.request.json", body)
            except InvalidPayload as exc:
                log.warning("bad-abort-notice", error=exc.message)
                return
            loop.abort(body["turnId"], str(body.get("reason") or "requested"))

    @router.after_startup
    async def _started(_app: FastAPI) -> None:
        await queue.ensure()
        if runs_turns:
            loop.start()
        state["started"] = True

    @router.on_broker_shutdown
    async def _drain_turns(_app: Any = None) -> None:
        # running turns get the drain window, then go back to the queue for another replica to resume
        await loop.drain(settings.drain_timeout_s)
        await web.aclose()

    app = FastAPI(title="ctxbuild orchestration", version="0.2.0",
                  description="HTTP/SSE edge of ctxbuild: conversations, attachments, turns (durable, resumable), "
                              "progress, served requests, tool-result read-back.")
    app.include_router(router)
    auth = Authenticator(AuthConfig.from_settings(settings), backends.read_stream_all)
    if settings.role in ("all", "edge"):
        app.include_router(build_api(backends, queue, settings.sse_poll_s,
                                     lambda spec: check_provider(spec, settings), settings.max_steps_limit,
                                     EdgeLimits.from_settings(settings), auth, settings.abort_grace_s))
    app.state.broker = broker
    app.state.runner_loop = loop
    install_error_handlers(app, auth)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/readyz", include_in_schema=False)
    async def readyz() -> JSONResponse:
        """Ready = started, NATS answers and (runner role) the turn consumer is consuming: a pull loop that
        crashed (being restarted) or cannot fetch is not ready (SPEC §15.4)."""
        failing = [] if state["started"] else ["starting"]
        if not await broker.ping(timeout=1.0):
            failing.append("nats")
        body: dict[str, Any] = {}
        if runs_turns:
            body["consumers"] = [queue.health.report()]
            if state["started"] and not queue.health.ok:
                failing.append(f"consumer:{queue.health.name}")
        if failing:
            return JSONResponse({"status": "not-ready", "failing": failing, **body}, status_code=503)
        return JSONResponse({"status": "ready", **body})

    return app


def main() -> None:
    settings = Settings()
    serve(create_app(settings), settings)


if __name__ == "__main__":
    main()
