"""Start-up: `python -m ctxbuild_compaction` (CTX_NATS_URL, CTX_HTTP_PORT, CTX_SERVICE_NAME)."""

from __future__ import annotations

from typing import Any

from ctxbuild_blobclient import BlobClient
from ctxbuild_platform.rpc import RpcClient, rpc
from ctxbuild_platform.service import make_app, make_broker, serve

from .adapters.blobstore import BlobStore
from .adapters.persistence import History
from .adapters.providers import make_provider
from .handlers import Summarizers, in_loop, turn_start
from .settings import Settings

QUEUE = "compaction"


def build(settings: Settings):  # -> the ASGI app
    broker = make_broker(settings)
    client = RpcClient(broker, settings.request_timeout_s)
    history = History(client, settings.history_timeout_s, settings.append_timeout_s)
    blobs = BlobStore(BlobClient(client, tune_reads=False), settings.blob_put_timeout_s)
    summarizers = Summarizers(settings.summarizer, put=blobs.put,
                              provider_for=lambda kind, model: make_provider(kind, model, settings),
                              summarizer_provider=settings.summarizer_provider,
                              summarizer_model=settings.summarizer_model,
                              summarizer_window=settings.summarizer_window)

    @rpc(broker, "ctx.compact.turn_start", queue=QUEUE, max_workers=settings.max_workers)
    async def compact_turn_start(payload: dict[str, Any]) -> dict[str, Any]:
        """Served history + retained context + the compaction decision for the path to the anchor; a new summary
        is stored once, as CompactionSummaryRecorded at its boundary."""
        return await turn_start(payload, history, summarizers, archive=blobs)

    @rpc(broker, "ctx.compact.in_loop", queue=QUEUE, max_workers=settings.max_workers)
    async def compact_in_loop(payload: dict[str, Any]) -> dict[str, Any]:
        """Between two steps of a turn: the request to serve next, from the memoised fold checkpoint (zero
        summarizer calls while it fits; only the increment is folded when it does not)."""
        return await in_loop(payload, history, summarizers, checkpoints=blobs)

    return make_app(settings, broker)


def create_app(settings: Settings | None = None):
    """The app, for `make contracts` (AsyncAPI) and for tests; no connection is made until it starts."""
    return build(settings or Settings())


def main() -> None:
    settings = Settings()
    serve(build(settings), settings)


if __name__ == "__main__":
    main()
