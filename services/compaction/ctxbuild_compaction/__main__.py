"""Start-up: `python -m ctxbuild_compaction` (CTX_NATS_URL, CTX_HTTP_PORT, CTX_SERVICE_NAME)."""

from __future__ import annotations

from typing import Any

from ctxbuild_platform.rpc import RpcClient, rpc
from ctxbuild_platform.service import make_app, make_broker, serve

from .adapters.persistence import History
from .handlers import turn_start
from .settings import Settings

QUEUE = "compaction"


def build(settings: Settings):  # -> the ASGI app
    broker = make_broker(settings)
    history = History(RpcClient(broker, settings.request_timeout_s), settings.history_timeout_s)

    @rpc(broker, "ctx.compact.turn_start", queue=QUEUE, max_workers=settings.max_workers)
    async def compact_turn_start(payload: dict[str, Any]) -> dict[str, Any]:
        """Served history + retained context + the compaction decision for the path to the anchor."""
        return await turn_start(payload, history)

    return make_app(settings, broker)


def create_app(settings: Settings | None = None):
    """The app, for `make contracts` (AsyncAPI) and for tests; no connection is made until it starts."""
    return build(settings or Settings())


def main() -> None:
    settings = Settings()
    serve(build(settings), settings)


if __name__ == "__main__":
    main()
