"""Service runner: a FastStream NATS app behind uvicorn with health endpoints and graceful SIGTERM.

- ``/healthz`` liveness: the process answers (nothing else — a dead dependency must not restart us).
- ``/readyz`` readiness: broker connected + every dependency check of the service.
- SIGTERM: uvicorn stops taking HTTP, the lifespan shuts FastStream down: the ``@rpc`` subjects drain, then
  FastStream's subscriptions (in-flight handlers finish within ``drain_timeout_s``), then the connection closes
  and the process exits.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import uvicorn
from faststream.asgi import AsgiFastStream, AsgiResponse, get
from faststream.nats import NatsBroker
from tenacity import AsyncRetrying, stop_after_delay, wait_exponential_jitter

from . import claims, rpc
from .logging import configure_logging
from .settings import ServiceSettings
from .telemetry import TracingMiddleware, configure_tracing

ReadinessCheck = Callable[[], Awaitable[bool]]
S = TypeVar("S", bound=ServiceSettings)


def broker_options(settings: ServiceSettings) -> dict[str, Any]:
    """Connection options shared by a plain NatsBroker and FastStream's FastAPI NatsRouter. Also installs the
    process's claim-check settings (every broker of the process uses them)."""
    claims.configure(claims.ClaimConfig.from_settings(settings))
    provider = configure_tracing(settings.service_name,
                                 str(settings.otel_exporter_otlp_endpoint or "") or None)
    return {
        "servers": str(settings.nats_url),
        "name": f"ctxbuild-{settings.service_name}",
        "inbox_prefix": settings.nats_inbox_prefix,  # replies, transfer and JetStream deliveries all use it
        "middlewares": [TracingMiddleware(tracer_provider=provider)],
        "graceful_timeout": settings.drain_timeout_s,
        "max_reconnect_attempts": -1,
        "logger": None,
    }


def make_broker(settings: ServiceSettings) -> NatsBroker:
    return NatsBroker(**broker_options(settings))


def make_app(settings: ServiceSettings, broker: NatsBroker, *,
             readiness: Sequence[tuple[str, ReadinessCheck]] = (),
             on_startup: Sequence[Callable[[], Awaitable[Any]]] = (),
             after_startup: Sequence[Callable[[], Awaitable[Any]]] = (),
             on_shutdown: Sequence[Callable[[], Awaitable[Any]]] = (),
             after_shutdown: Sequence[Callable[[], Awaitable[Any]]] = (),
             extra_routes: Sequence[tuple[str, Any]] = ()) -> AsgiFastStream:
    log = configure_logging(settings.service_name, settings.log_level)
    # uvicorn serves HTTP before FastStream has subscribed; ready only once after_startup has run
    state = {"started": False}

    @get(include_in_schema=False)
    async def healthz(scope: Any) -> AsgiResponse:
        return AsgiResponse(b'{"status":"alive"}', 200, headers={"content-type": "application/json"})

    @get(include_in_schema=False)
    async def readyz(scope: Any) -> AsgiResponse:
        failing: list[str] = [] if state["started"] else ["starting"]
        if not await broker.ping(timeout=1.0):
            failing.append("nats")
        for name, check in readiness:
            try:
                ok = await asyncio.wait_for(check(), timeout=2.0)
            except Exception:  # noqa: BLE001 - any failure is "not ready"
                ok = False
            if not ok:
                failing.append(name)
        if failing:
            body = json.dumps({"status": "not-ready", "failing": failing}).encode()
            return AsgiResponse(body, 503, headers={"content-type": "application/json"})
        return AsgiResponse(b'{"status":"ready"}', 200, headers={"content-type": "application/json"})

    def patient(step: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
        """Start-up steps that need a dependency retry with backoff (the usual cluster start order race)
        instead of exiting at the first refusal; after `startup_timeout_s` the process exits and the
        orchestrator restarts it."""
        async def run() -> Any:
            async for attempt in AsyncRetrying(
                    stop=stop_after_delay(settings.startup_timeout_s),
                    wait=wait_exponential_jitter(initial=0.2, max=5), reraise=True):
                with attempt:
                    if attempt.retry_state.attempt_number > 1:
                        log.warning("startup-retry", step=getattr(step, "__name__", "step"),
                                    attempt=attempt.retry_state.attempt_number)
                    return await step()
        return run

    async def serve_rpc() -> None:
        # before the service's own steps: they may call other services, which may call this one
        await rpc.start_servers(broker)

    async def drain_rpc() -> None:
        await rpc.stop_servers(broker, settings.drain_timeout_s)

    async def started() -> None:
        state["started"] = True
        log.info("service-started", http_port=settings.http_port)

    return AsgiFastStream(
        broker,
        asgi_routes=[("/healthz", healthz), ("/readyz", readyz), *extra_routes],
        on_startup=[patient(step) for step in on_startup],
        after_startup=[serve_rpc, *after_startup, started],
        # the @rpc subjects drain after the service's own steps (as FastStream's subscribers did) and before the
        # broker stops, so their in-flight replies still have the connection
        on_shutdown=[*on_shutdown, drain_rpc],
        # after the broker drained: the place to close pools in-flight handlers still use
        after_shutdown=list(after_shutdown),
        logger=None,
    )


def _drained(signum: int, frame: Any) -> None:
    """The handler uvicorn restores once it has shut down gracefully and then re-raises the signal into: the
    service has drained, so the signal has done its work and the process goes on to exit 0."""


def serve(app: Any, settings: ServiceSettings) -> None:
    """Run until SIGTERM/SIGINT: stop taking HTTP, run the lifespan shutdown (FastStream drains), exit 0.

    uvicorn re-raises a captured signal into the handler that was installed before it started (the default one
    would end a drained service with status -15): installing :func:`_drained` first makes that a no-op."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _drained)
    config = uvicorn.Config(app, host=settings.http_host, port=settings.http_port, log_config=None,
                            access_log=False, timeout_graceful_shutdown=int(settings.drain_timeout_s) + 1,
                            lifespan="on")
    uvicorn.Server(config).run()


def entry_points(build: Callable[[S], Any], settings_type: Callable[[], S]) -> tuple[Callable[..., Any],
                                                                                   Callable[[], None]]:
    """A service's ``create_app`` and ``main`` from its ``build(settings)`` (``__main__``:
    ``create_app, main = entry_points(build, Settings)``).

    - ``create_app(settings=None)``: the app, unconnected until it starts (for `make contracts`' AsyncAPI and for
      tests); settings from the environment when none are given.
    - ``main()``: settings from the environment, then :func:`serve` until SIGTERM (drain, exit 0).
    """
    def create_app(settings: S | None = None) -> Any:
        return build(settings or settings_type())

    def main() -> None:
        settings = settings_type()
        serve(build(settings), settings)

    return create_app, main
