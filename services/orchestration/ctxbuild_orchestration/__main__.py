"""`python -m ctxbuild_orchestration`: the HTTP/SSE edge and the turn runner on FastStream's NATS router.

``CTX_ROLE`` splits them for scaling (edge on CPU, runners on work-queue lag); ``all`` (the default, local runs)
serves both from one process.
"""

from __future__ import annotations

from typing import Any

from ctxbuild_platform.deadletter import DeadLetterConfig, DeadLetters
from ctxbuild_platform.logging import configure_logging
from ctxbuild_platform.rpc import RpcClient
from ctxbuild_platform.service import broker_options, entry_points
from fastapi import FastAPI
from faststream.nats.fastapi import NatsRouter

from .adapters.auth import AuthConfig, Authenticator
from .adapters.backends import Backends
from .adapters.web import WebTools
from .adapters.work_queue import QueueConfig, TurnQueue
from .app.edge import Edge, EdgeLimits
from .app.gateway import Gateway, GatewayConfig
from .app.providers import check_provider, provider_factory
from .app.runner import TurnRunner, new_id
from .app.runner_loop import RunnerLoop
from .handlers import RunnerHandlers, register_runner
from .inspector import build_inspector
from .routers import build_api, health, install_error_handlers
from .routers.gateway import build_gateway
from .routers.health import Readiness
from .settings import Settings


def build(settings: Settings) -> FastAPI:
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
        stream=settings.turns_stream, subject=settings.turns_subject, durable=settings.turns_consumer,
        ack_wait_s=settings.turn_ack_wait_s,
        replicas=settings.turns_stream_replicas, max_deliveries=settings.turn_max_deliveries), dead_letters)
    web = WebTools(settings, mcp_invoke=lambda tool_id, args: backends.invoke(tool_id, args, new_id("call")))
    runner = TurnRunner(runner_backends, provider_factory(settings, runner_backends),
                        default_max_steps=settings.max_steps, keep_requests=settings.keep_served_requests,
                        web_tools=web, terminal_patience_s=settings.terminal_patience_s,
                        compaction_timeout_s=settings.compaction_timeout_s,
                        compaction_heartbeat_s=settings.compaction_heartbeat_s,
                        local_turn_start_plan=settings.turn_start_local_plan,
                        keep_request_patience_s=settings.keep_request_patience_s,
                        lazy_turn_start_s=settings.lazy_turn_start_s)
    loop = RunnerLoop(queue, runner, settings)
    runs_turns = settings.role in ("all", "runner")
    readiness = Readiness(broker, queue, runs_turns)

    if runs_turns:
        register_runner(router, RunnerHandlers(loop))

    @router.after_startup
    async def _started(_app: FastAPI) -> None:
        await queue.ensure()
        if runs_turns:
            loop.start()
        readiness.started = True

    @router.on_broker_shutdown
    async def _drain_turns(_app: Any = None) -> None:
        # running turns get the drain window, then go back to the queue for another replica to resume
        await loop.drain(settings.drain_timeout_s)
        await web.aclose()

    app = FastAPI(title="ctxbuild orchestration", version="0.2.0",
                  description="HTTP/SSE edge of ctxbuild: conversations, attachments, turns (durable, resumable), "
                              "progress, served requests, tool-result read-back.",
                  # the HTTP server span of every request stays; FastAPI's own spans of its internals (dependency
                  # resolution, the endpoint call, serialisation) go, as its request metrics do (no meter provider)
                  telemetry={"operation_spans": False, "metrics": False})
    app.include_router(router)
    auth = Authenticator(AuthConfig.from_settings(settings), backends.read_stream_all)
    if settings.role in ("all", "edge"):
        edge = Edge(backends, queue, lambda spec: check_provider(spec, settings), settings.max_steps_limit,
                    EdgeLimits.from_settings(settings), auth, settings.abort_grace_s, settings.admission_grace_s)
        app.include_router(build_api(edge, settings.sse_poll_s))
        # the drop-in gateway (SPEC §15.5): OpenAI and Anthropic wire formats over the same turns
        gateway = Gateway(edge, GatewayConfig.from_settings(settings), lambda spec: check_provider(spec, settings))
        app.include_router(build_gateway(gateway, edge.limits, auth))
        app.include_router(build_inspector(edge, auth, trace_ui_url=settings.trace_ui_url,  # /ui (issue #20)
                                           sse_poll_s=settings.sse_poll_s))
    app.state.broker = broker
    app.state.runner_loop = loop
    install_error_handlers(app, auth)

    app.include_router(health.router(readiness))
    return app


create_app, main = entry_points(build, Settings)


if __name__ == "__main__":
    main()
