"""Persistence as seen from compaction: the conversation's path to the anchor plus its attachment list."""

from __future__ import annotations

from typing import Any

from ctxbuild_platform.rpc import RpcClient


class History:
    def __init__(self, client: RpcClient, timeout_s: float) -> None:
        self.client = client
        self.timeout_s = timeout_s

    async def history(self, conversation_id: str, anchor_id: str | None = None) -> dict[str, Any]:
        """`ctx.persist.history`; a RemoteError (typed, with its retryable flag) propagates to our caller."""
        payload: dict[str, Any] = {"conversationId": conversation_id}
        if anchor_id:
            payload["anchorId"] = anchor_id
        return await self.client.call("ctx.persist.history", payload, timeout=self.timeout_s)
