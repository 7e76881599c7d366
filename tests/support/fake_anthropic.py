"""A local server speaking the Anthropic Messages wire format, checking the rules the real API enforces that a
client can get wrong: alternating roles starting with user, every tool_result answering a tool_use of the
previous assistant turn, at most 4 cache_control breakpoints, tool input schemas of type object.

``"stream": true`` is answered the way the Messages API streams: SSE events ``message_start`` (usage with the
cache counts), a ``ping``, per block ``content_block_start`` / ``content_block_delta`` (``text_delta`` pieces,
``input_json_delta`` fragments of the tool input) / ``content_block_stop``, then ``message_delta`` (stop_reason,
output_tokens) and ``message_stop``.

Test knobs (each applies to the next request only): ``fail_next`` (an HTTP status), ``reply_next`` (the content
blocks to answer with; a tool_use block may carry ``"raw_input"``, the exact JSON text to stream), ``break_next``
(``"cut"``: the body ends before message_stop; ``"drop"``: the connection is lost mid-body; ``"overloaded"``: an
``event: error`` of type overloaded_error mid-stream).

``[[fake: …]]`` in the last user message runs the client-tool script of :mod:`tests.support.fake_openai`
(:class:`~tests.support.fake_openai.Script`) on the Messages format; ``GET /_recorded?since=n`` returns the
recorded bodies.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from itertools import pairwise
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.support.fake_openai import Script, Turn, pieces
from tests.support.server import ThreadedServer


def wire_errors(body: dict[str, Any]) -> list[str]:
    errors = []
    msgs = body.get("messages", [])
    if not msgs or msgs[0]["role"] != "user":
        errors.append("first message must be user")
    for a, b in pairwise(msgs):
        if a["role"] == b["role"]:
            errors.append("roles must alternate")
    for i, m in enumerate(msgs):
        results = [c for c in m["content"] if c.get("type") == "tool_result"]
        if results:
            prev = msgs[i - 1] if i else {"content": []}
            uses = {c["id"] for c in prev["content"] if c.get("type") == "tool_use"}
            if any(r["tool_use_id"] not in uses for r in results):
                errors.append(f"messages.{i}: tool_result without a matching tool_use")
    blocks = [*body.get("tools", []), *(body.get("system") or []),
              *(c for m in msgs for c in m["content"])]
    if sum(1 for b in blocks if isinstance(b, dict) and "cache_control" in b) > 4:
        errors.append("more than 4 cache_control breakpoints")
    for t in body.get("tools", []):
        if t["input_schema"].get("type") != "object":
            errors.append(f"tool {t['name']}: input_schema.type must be object")
    return errors


def anthropic_turns(messages: list[dict[str, Any]]) -> list[Turn]:
    def text(content: Any) -> str:
        if isinstance(content, str):
            return content
        return "".join(c.get("text", "") for c in content or [] if c.get("type") == "text")

    out = []
    for m in messages:
        blocks = [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else m["content"]
        results = [(c["tool_use_id"], text(c.get("content"))) for c in blocks if c.get("type") == "tool_result"]
        if results:  # a user message's tool results come first (the API's rule), its text after
            out.append(Turn("tool", results=results))
        calls = [(c["id"], c["name"], c.get("input") or {}) for c in blocks if c.get("type") == "tool_use"]
        said = text(blocks)
        if said or calls or not results:
            out.append(Turn(m["role"], said, calls))
    return out


class FakeAnthropic(ThreadedServer):
    def __init__(self, port: int) -> None:
        self.requests: list[dict[str, Any]] = []
        self.fail_next: int | None = None
        self.reply_next: list[dict[str, Any]] | None = None
        self.break_next: str | None = None
        self.delay_next_s: float = 0.0  # wait this long before answering the next request (a slow model)
        super().__init__(Starlette(routes=[Route("/v1/messages", self.messages, methods=["POST"]),
                                           Route("/_recorded", self.recorded)]), port)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def recorded(self, request: Request) -> Response:
        return JSONResponse(self.requests[int(request.query_params.get("since", 0)):])

    def scripted(self, body: dict[str, Any]) -> list[dict[str, Any]] | None:
        system = body.get("system") or ""
        system = system if isinstance(system, str) else "".join(b.get("text", "") for b in system)
        turns = [Turn("system", system), *anthropic_turns(body["messages"])]
        found = Script.of(turns)
        if found is None:
            return None
        script, at = found
        text, calls = script.decide(turns, at, [t["name"] for t in body.get("tools", [])])
        n = len(self.requests)
        return ([{"type": "text", "text": text}] if text or not calls else []) + [
            {"type": "tool_use", "id": f"toolu_{n}_{j}", "name": name, "input": args}
            for j, (name, args) in enumerate(calls)]

    def decide(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        scripted = self.scripted(body)
        if scripted is not None:
            return scripted
        last = body["messages"][-1]["content"]
        if any(c.get("type") == "tool_result" for c in last):
            return [{"type": "text", "text": f"got {len(last)} result(s)"}]
        tool = body["tools"][0]["name"]
        return [{"type": "text", "text": "let me look"},
                {"type": "tool_use", "id": f"toolu_{len(self.requests)}", "name": tool, "input": {"q": 1}}]

    async def messages(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        if self.delay_next_s:
            delay, self.delay_next_s = self.delay_next_s, 0.0
            await asyncio.sleep(delay)
        if self.fail_next:
            status, self.fail_next = self.fail_next, None
            return JSONResponse({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
                                status_code=status)
        errors = wire_errors(body)
        if errors:
            return JSONResponse({"type": "error", "error": {"type": "invalid_request_error",
                                                             "message": "; ".join(errors)}}, status_code=400)
        content, self.reply_next = self.reply_next or self.decide(body), None
        stop = "tool_use" if any(c["type"] == "tool_use" for c in content) else "end_turn"
        cached = len(self.requests) > 1
        usage = {"input_tokens": 50, "output_tokens": 9, "cache_read_input_tokens": 400 if cached else 0,
                 "cache_creation_input_tokens": 0 if cached else 400}
        message = {"id": f"msg_{len(self.requests)}", "type": "message", "role": "assistant", "model": body["model"],
                   "stop_sequence": None}
        if not body.get("stream"):
            blocks = [{k: v for k, v in c.items() if k != "raw_input"} for c in content]
            return JSONResponse({**message, "content": blocks, "stop_reason": stop, "usage": usage})
        fault, self.break_next = self.break_next, None
        return StreamingResponse(self.sse(self.events(message, content, stop, usage), fault),
                                 media_type="text/event-stream")

    @staticmethod
    def events(message: dict[str, Any], content: list[dict[str, Any]], stop: str,
               usage: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        start_usage = {**usage, "output_tokens": 1}  # the API reports output so far; message_delta has the total
        out = [("message_start", {"type": "message_start", "message": {**message, "content": [], "stop_reason": None,
                                                                        "usage": start_usage}}),
               ("ping", {"type": "ping"})]
        for i, block in enumerate(content):
            if block["type"] == "text":
                out.append(("content_block_start", {"type": "content_block_start", "index": i,
                                                    "content_block": {"type": "text", "text": ""}}))
                out += [("content_block_delta", {"type": "content_block_delta", "index": i,
                                                 "delta": {"type": "text_delta", "text": p}})
                        for p in pieces(block["text"])]
            else:
                raw = block.get("raw_input", json.dumps(block.get("input", {})))
                out.append(("content_block_start", {"type": "content_block_start", "index": i, "content_block": {
                    "type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}}))
                out += [("content_block_delta", {"type": "content_block_delta", "index": i,
                                                 "delta": {"type": "input_json_delta", "partial_json": p}})
                        for p in pieces(raw, 4)]
            out.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
        out.append(("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                                      "usage": {"output_tokens": usage["output_tokens"]}}))
        out.append(("message_stop", {"type": "message_stop"}))
        return out

    @staticmethod
    async def sse(events: list[tuple[str, dict[str, Any]]], fault: str | None) -> AsyncIterator[bytes]:
        for n, (name, data) in enumerate(events):
            if fault and n == 3:
                if fault == "overloaded":
                    yield (b'event: error\ndata: {"type": "error", "error": {"type": "overloaded_error", '
                           b'"message": "Overloaded"}}\n\n')
                if fault == "drop":
                    raise ConnectionAbortedError("fake: connection dropped mid-stream")
                return  # "cut": the body ends cleanly before message_stop
            yield f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
