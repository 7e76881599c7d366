"""A local server speaking the OpenAI chat-completions wire format, for tests of the real adapter.

It behaves like a small, deterministic model: after a user message it calls `read_file` on the first
attachment handle it is told about (if that tool is offered), then answers with the length of what it read.
Every request body is recorded so tests can check exactly what went over the wire.
"""

from __future__ import annotations

import re
import time
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.support.server import ThreadedServer


class FakeOpenAI(ThreadedServer):
    def __init__(self, port: int) -> None:
        self.requests: list[dict[str, Any]] = []
        self.fail_next: int | None = None  # HTTP status to answer the next request with
        super().__init__(Starlette(routes=[Route("/v1/chat/completions", self.completions, methods=["POST"])]), port)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def decide(self, body: dict[str, Any]) -> dict[str, Any]:
        msgs = body["messages"]
        since_user = msgs[max(i for i, m in enumerate(msgs) if m["role"] == "user"):]
        tools = {t["function"]["name"] for t in body.get("tools", [])}
        handles = re.findall(r"read_file handle: ([^)]+)\)", " ".join(str(m.get("content")) for m in msgs))
        results = [m for m in since_user if m["role"] == "tool"]
        if "read_file" in tools and handles and not results:
            return {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{len(self.requests)}", "type": "function",
                "function": {"name": "read_file", "arguments": f'{{"filename": "{handles[0]}", "limit": 500}}'}}]}
        read = sum(len(m["content"]) for m in results)
        return {"role": "assistant", "content": f"I read {read} characters."}

    async def completions(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.requests.append(body)
        if self.fail_next:
            status, self.fail_next = self.fail_next, None
            return JSONResponse({"error": {"message": "overloaded", "type": "server_error"}}, status_code=status)
        message = self.decide(body)
        prompt = sum(len(str(m.get("content") or "")) for m in body["messages"]) // 4
        return JSONResponse({
            "id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion", "created": int(time.time()),
            "model": body["model"],
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": 12, "total_tokens": prompt + 12,
                      "prompt_tokens_details": {"cached_tokens": prompt // 2}},
        })
