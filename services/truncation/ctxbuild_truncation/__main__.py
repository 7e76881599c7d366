"""Start-up: `python -m ctxbuild_truncation` (CTX_NATS_URL, CTX_HTTP_PORT, CTX_SERVICE_NAME)."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

from ctxbuild_blobclient import BlobClient
from ctxbuild_platform import claims
from ctxbuild_platform.rpc import RpcClient, raw_body
from ctxbuild_platform.service import entry_points, make_app, make_broker
from faststream.nats import NatsBroker
from faststream.nats.annotations import NatsMessage

from .adapters.blobstore import BlobStore
from .app import SUBJECT, Limits
from .handlers import StepHandler
from .settings import Settings

QUEUE = "truncation"
DESCRIPTION = "In-flight lane for one step's tool results: trim oversized outputs, offload the full text."


def subscribe(broker: NatsBroker, handler: StepHandler, max_workers: int) -> None:
    """`ctx.truncate.step`, queue group `truncation` (contracts are checked by the handler, as `rpc` does; a
    request or reply over the NATS inline limit travels by the platform's claim check, as with `rpc`)."""

    @broker.subscriber(SUBJECT, queue=QUEUE, max_workers=max_workers, title=SUBJECT, description=DESCRIPTION,
                       decoder=raw_body)  # the handler parses the body (on a CPU thread when it is large)
    async def step(message: NatsMessage) -> bytes:
        return await claims.answer(broker, message, handler.handle)


def build(settings: Settings):  # -> the ASGI app
    if settings.gil_switch_interval_s > 0:
        sys.setswitchinterval(settings.gil_switch_interval_s)
    broker = make_broker(settings)
    client = BlobClient(RpcClient(broker, settings.request_timeout_s), idle_timeout_s=settings.blob_idle_timeout_s,
                        timeout_s=settings.request_timeout_s)
    store = BlobStore(client, settings.blob_put_timeout_s, settings.blob_put_timeout_per_mib_s)
    executor = ThreadPoolExecutor(max_workers=max(1, settings.cpu_threads), thread_name_prefix="truncation-cpu")
    handler = StepHandler(store, executor, limits=Limits(settings.put_concurrency, settings.claim_inline_max_bytes),
                          loop_max_bytes=settings.loop_max_bytes, loop_max_parts=settings.loop_max_parts,
                          max_claims=settings.max_claims)
    subscribe(broker, handler, settings.max_workers)

    async def stop_threads() -> None:
        executor.shutdown(wait=True, cancel_futures=False)

    return make_app(settings, broker, after_shutdown=[stop_threads])


create_app, main = entry_points(build, Settings)


if __name__ == "__main__":
    main()
