"""The blob store as seen from masking: archive an output's full text with a provisional reference to the turn
(the same reference the in-flight lane uses), so the masked marker's URI is readable with fs_read."""

from __future__ import annotations

import structlog
from ctxbuild_platform.rpc import RpcClient

log = structlog.get_logger("compaction.blobstore")
INLINE_MAX_CHARS = 256 * 1024  # ctx.blob.put carries the text inline (NATS max_payload): larger texts stay whole


class BlobStore:
    def __init__(self, client: RpcClient, timeout_s: float) -> None:
        self.client = client
        self.timeout_s = timeout_s

    async def put(self, text: str, conversation_id: str, turn_id: str | None) -> str | None:
        """The archived URI, or None on any failure (the output then stays in full — never fails the fold)."""
        if len(text) > INLINE_MAX_CHARS or not conversation_id:
            return None
        owner = {"kind": "turn", "id": turn_id} if turn_id else {"kind": "conversation", "id": conversation_id}
        try:
            reply = await self.client.call("ctx.blob.put", {
                "content": text, "conversationId": conversation_id, "owner": owner,
                "role": "provisional" if turn_id else "tool_output", "mediaType": "text/plain"},
                timeout=self.timeout_s)
            return str(reply["uri"])
        except Exception as exc:  # noqa: BLE001 - unavailable, too large, malformed: keep the output
            log.warning("blob-put-failed", conversation_id=conversation_id, error=f"{type(exc).__name__}: {exc}"[:300])
            return None
