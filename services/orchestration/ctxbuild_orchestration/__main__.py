"""`python -m ctxbuild_orchestration`: FastAPI edge + turn runner on FastStream's NATS router."""

from __future__ import annotations

import asyncio

from typing import Any

from ctxbuild_platform.errors import ServiceError
from ctxbuild_platform.logging import configure_logging
from ctxbuild_platform.rpc import RpcClient
from ctxbuild_platform.service import broker_options, serve
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from faststream.nats.fastapi import NatsRouter

from ctxbuild_providers import AnthropicMessagesProvider, OpenAIChatProvider, Provider, ReplayProvider

from .adapters.backends import Backends
from .handlers import build_api, install_error_handlers
from .runner import TurnRunner
from .settings import Settings


def make_provider(spec: Any, settings: Settings) -> Provider:
    if spec.kind == "replay":
        return ReplayProvider(spec.script)
    if spec.kind == "anthropic":
        if settings.anthropic_api_key is None and settings.anthropic_base_url is None:
            raise ServiceError("no Anthropic endpoint configured: set CTX_ANTHROPIC_API_KEY on the orchestration "
                               "service", code="provider-not-configured")
        key = settings.anthropic_api_key.get_secret_value() if settings.anthropic_api_key else None
        return AnthropicMessagesProvider(spec.model, api_key=key, base_url=settings.anthropic_base_url)
    key = settings.openai_api_key.get_secret_value() if settings.openai_api_key else None
    if key is None and settings.openai_base_url is None:
        raise ServiceError("no OpenAI-compatible endpoint configured: set CTX_OPENAI_BASE_URL and/or "
                           "CTX_OPENAI_API_KEY on the orchestration service", code="provider-not-configured")
    return OpenAIChatProvider(spec.model, base_url=settings.openai_base_url, api_key=key)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    configure_logging(settings.service_name, settings.log_level)
    router = NatsRouter(**broker_options(settings))
    backends = Backends(RpcClient(router.broker, settings.request_timeout_s), settings.tool_timeout_s)
    runner = TurnRunner(backends, settings.max_steps, settings.default_model)
    api = build_api(backends, runner, settings.sse_poll_s, lambda spec: make_provider(spec, settings))
    state = {"started": False}

    @router.after_startup
    async def _started(_app: FastAPI) -> None:
        state["started"] = True

    @router.on_broker_shutdown
    async def _drain_turns() -> None:
        # let running turns finish within the drain window, then cancel (they record TurnFailed)
        tasks = list(api.state_tasks)  # type: ignore[attr-defined]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=settings.drain_timeout_s)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    app = FastAPI(title="ctxbuild orchestration", version="0.1.0",
                  description="HTTP/SSE edge of ctxbuild: conversations, attachments, turns, progress.")
    app.include_router(router)
    app.include_router(api)
    app.state.broker = router.broker
    install_error_handlers(app)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/readyz", include_in_schema=False)
    async def readyz() -> JSONResponse:
        ok = state["started"] and await router.broker.ping(timeout=1.0)
        return JSONResponse({"status": "ready" if ok else "not-ready"}, status_code=200 if ok else 503)

    return app


def main() -> None:
    settings = Settings()
    serve(create_app(settings), settings)


if __name__ == "__main__":
    main()
