"""A local server speaking the OpenAI chat-completions wire format, for tests of the real adapter.

It behaves like a small, deterministic model: after a user message it calls `read_file` on the first
attachment handle it is told about (if that tool is offered), then answers with the length of what it read.
Every request body is recorded so tests can check exactly what went over the wire.

``"stream": true`` is answered the way OpenAI streams: SSE ``data: {chunk}`` lines — the role first, the text in
several deltas, each tool call as an id+name fragment followed by argument fragments, the finish_reason, then
(with ``stream_options.include_usage``) a usage chunk with no choices — ending ``data: [DONE]``. Usage reports
``prompt_tokens_details.cached_tokens``.

Test knobs (each applies to the next request only): ``fail_next`` (an HTTP status), ``reply_next`` (the
assistant message to answer with instead of deciding), ``delay_next_s`` (seconds before answering), ``hold_next``
(a ``threading.Event``: the request waits until it is set — a model that answers when the test says so),
``break_next`` (``"cut"``: the body ends mid-way without finish_reason or [DONE]; ``"drop"``: the connection is
lost mid-body; ``"error"``: an error object arrives mid-stream).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.support.server import ThreadedServer


def pieces(text: str, n: int = 3) -> list[str]:
    """``text`` in ``n`` roughly equal pieces (so a client must join deltas to get it back)."""
    size = max(1, -(-len(text) // n))
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


class FakeOpenAI(ThreadedServer):
    def __init__(self, port: int) -> None:
        self.requests: list[dict[str, Any]] = []
        self.fail_next: int | None = None  # HTTP status to answer the next request with
        self.reply_next: dict[str, Any] | None = None
        self.break_next: str | None = None
        self.delay_next_s: float = 0.0  # wait this long before answering the next request (a slow model)
        self.hold_next: threading.Event | None = None  # the next request waits until the test sets it
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

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        if self.hold_next is not None:
            hold, self.hold_next = self.hold_next, None
            await asyncio.to_thread(hold.wait, 300)
        if self.delay_next_s:
            delay, self.delay_next_s = self.delay_next_s, 0.0
            await asyncio.sleep(delay)
        if self.fail_next:
            status, self.fail_next = self.fail_next, None
            return JSONResponse({"error": {"message": "overloaded", "type": "server_error"}}, status_code=status)
        message, self.reply_next = self.reply_next or self.decide(body), None
        prompt = sum(len(str(m.get("content") or "")) for m in body["messages"]) // 4
        usage = {"prompt_tokens": prompt, "completion_tokens": 12, "total_tokens": prompt + 12,
                 "prompt_tokens_details": {"cached_tokens": prompt // 2}}
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        head = {"id": f"chatcmpl-{len(self.requests)}", "created": int(time.time()), "model": body["model"]}
        if not body.get("stream"):
            return JSONResponse({**head, "object": "chat.completion",
                                 "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                                 "usage": usage})
        with_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        fault, self.break_next = self.break_next, None
        chunks = self.chunks(head, message, finish, usage if with_usage else None)
        return StreamingResponse(self.sse(chunks, fault), media_type="text/event-stream")

    @staticmethod
    def chunks(head: dict[str, Any], message: dict[str, Any], finish: str,
               usage: dict[str, Any] | None) -> list[dict[str, Any]]:
        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
            return {**head, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}

        out = [chunk({"role": "assistant", "content": ""})]
        out += [chunk({"content": p}) for p in pieces(message["content"])] if message.get("content") else []
        for i, call in enumerate(message.get("tool_calls") or []):
            out.append(chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                              "function": {"name": call["function"]["name"], "arguments": ""}}]}))
            out += [chunk({"tool_calls": [{"index": i, "function": {"arguments": p}}]})
                    for p in pieces(call["function"]["arguments"], 4)]
        out.append(chunk({}, finish))
        if usage is not None:
            out.append({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage})
        return out

    @staticmethod
    async def sse(chunks: list[dict[str, Any]], fault: str | None) -> AsyncIterator[bytes]:
        for n, c in enumerate(chunks):
            if fault and n == 2:
                if fault == "error":
                    yield b'data: {"error": {"message": "the model crashed", "type": "server_error"}}\n\n'
                if fault == "drop":
                    raise ConnectionAbortedError("fake: connection dropped mid-stream")  # no final chunk
                return  # "cut": the body ends cleanly, with no finish_reason and no [DONE]
            yield f"data: {json.dumps(c)}\n\n".encode()
        yield b"data: [DONE]\n\n"
