"""Start-up: `python -m ctxbuild_truncation` (CTX_NATS_URL, CTX_HTTP_PORT, CTX_SERVICE_NAME)."""

from __future__ import annotations

from typing import Any

from ctxbuild_platform.rpc import RpcClient, rpc
from ctxbuild_platform.service import make_app, make_broker, serve

from .adapters.blobstore import BlobStore
from .handlers import truncate_step
from .settings import Settings

QUEUE = "truncation"


def build(settings: Settings):  # -> the ASGI app
    broker = make_broker(settings)
    blobs = BlobStore(RpcClient(broker, settings.request_timeout_s), settings.blob_put_timeout_s)

    @rpc(broker, "ctx.truncate.step", queue=QUEUE, max_workers=settings.max_workers)
    async def step(payload: dict[str, Any]) -> dict[str, Any]:
        """In-flight lane for one step's tool results: trim oversized outputs, offload the full text."""
        return await truncate_step(payload, blobs)

    return make_app(settings, broker)


def create_app(settings: Settings | None = None):
    """The app, for `make contracts` (AsyncAPI) and for tests; no connection is made until it starts."""
    return build(settings or Settings())


def main() -> None:
    settings = Settings()
    serve(build(settings), settings)


if __name__ == "__main__":
    main()
