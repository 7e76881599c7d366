"""The blob store as seen from the in-flight lane: `ctx.blob.put` with a provisional reference to the turn."""

from __future__ import annotations

import structlog
from ctxbuild_platform.rpc import RpcClient

from ..domain import PutResult

log = structlog.get_logger("blobstore-adapter")


class BlobStore:
    def __init__(self, client: RpcClient, timeout_s: float) -> None:
        self.client = client
        self.timeout_s = timeout_s

    async def put_provisional(self, text: str, conversation_id: str, turn_id: str) -> PutResult | None:
        """Store the full text; None on any failure (the caller falls back to inline — never fails the step)."""
        try:
            reply = await self.client.call("ctx.blob.put", {
                "content": text,
                "conversationId": conversation_id,
                "owner": {"kind": "turn", "id": turn_id},
                "role": "provisional",
                "mediaType": "text/plain",
            }, timeout=self.timeout_s)
            return PutResult(uri=str(reply["uri"]), sha256=str(reply["sha256"]))
        except Exception as exc:  # noqa: BLE001 - RemoteError, payload too large, malformed reply: all fall back
            log.warning("blob-put-failed", conversation_id=conversation_id, turn_id=turn_id,
                        error=f"{type(exc).__name__}: {exc}"[:300])
            return None
