"""Start-up: `python -m ctxbuild_compaction` (CTX_NATS_URL, CTX_HTTP_PORT, CTX_SERVICE_NAME)."""

from __future__ import annotations

from ctxbuild_blobclient import BlobClient
from ctxbuild_platform.rpc import RpcClient
from ctxbuild_platform.service import entry_points, make_app, make_broker

from .adapters.blobstore import BlobStore
from .adapters.persistence import History
from .adapters.providers import make_provider
from .app import Compaction, Summarizers
from .handlers import register
from .settings import Settings


def build(settings: Settings):  # -> the ASGI app
    broker = make_broker(settings)
    client = RpcClient(broker, settings.request_timeout_s)
    history = History(client, settings.history_timeout_s, settings.append_timeout_s)
    blobs = BlobStore(BlobClient(client), settings.blob_put_timeout_s)
    summarizers = Summarizers(settings.summarizer, put=blobs.put,
                              provider_for=lambda kind, model: make_provider(kind, model, settings),
                              summarizer_provider=settings.summarizer_provider,
                              summarizer_model=settings.summarizer_model,
                              summarizer_window=settings.summarizer_window)

    register(broker, Compaction(history, summarizers, blobs), max_workers=settings.max_workers)
    return make_app(settings, broker)


create_app, main = entry_points(build, Settings)


if __name__ == "__main__":
    main()
