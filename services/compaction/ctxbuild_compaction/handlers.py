"""`ctx.compact.turn_start` and `ctx.compact.in_loop`: thin typed handlers (request model → the use case → reply
model); the use cases are in :mod:`.app`."""

from __future__ import annotations

from ctxbuild_codec.contract_models import dump
from ctxbuild_codec.models.subjects.ctx_compact_in_loop_reply import CtxCompactInLoopReply
from ctxbuild_codec.models.subjects.ctx_compact_in_loop_request import CtxCompactInLoopRequest
from ctxbuild_codec.models.subjects.ctx_compact_turn_start_reply import CtxCompactTurnStartReply
from ctxbuild_codec.models.subjects.ctx_compact_turn_start_request import CtxCompactTurnStartRequest
from ctxbuild_platform.rpc import rpc
from faststream.nats import NatsBroker

from .app import Compaction

QUEUE = "compaction"


class Handlers:
    """The subjects' handlers over the use cases (registered bound by :func:`register`)."""

    def __init__(self, app: Compaction) -> None:
        self.app = app

    async def compact_turn_start(self, req: CtxCompactTurnStartRequest) -> CtxCompactTurnStartReply:
        """Served history + retained context + the compaction decision for the path to the anchor; a new summary
        is stored once, as CompactionSummaryRecorded at its boundary."""
        return CtxCompactTurnStartReply.model_validate(await self.app.turn_start(dump(req)))

    async def compact_in_loop(self, req: CtxCompactInLoopRequest) -> CtxCompactInLoopReply:
        """Between two steps of a turn: the request to serve next, from the memoised fold checkpoint (zero
        summarizer calls while it fits; only the increment is folded when it does not)."""
        return CtxCompactInLoopReply.model_validate(await self.app.in_loop(dump(req)))


def register(broker: NatsBroker, app: Compaction, *, max_workers: int) -> None:
    handlers = Handlers(app)
    rpc(broker, "ctx.compact.turn_start", queue=QUEUE, max_workers=max_workers)(handlers.compact_turn_start)
    rpc(broker, "ctx.compact.in_loop", queue=QUEUE, max_workers=max_workers)(handlers.compact_in_loop)
