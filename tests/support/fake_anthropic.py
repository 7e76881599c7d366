"""A local server speaking the Anthropic Messages wire format, checking the rules the real API enforces that a
client can get wrong: alternating roles starting with user, every tool_result answering a tool_use of the
previous assistant turn, at most 4 cache_control breakpoints, tool input schemas of type object."""

from __future__ import annotations

from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.support.server import ThreadedServer


def wire_errors(body: dict[str, Any]) -> list[str]:
    errors = []
    msgs = body.get("messages", [])
    if not msgs or msgs[0]["role"] != "user":
        errors.append("first message must be user")
    for a, b in zip(msgs, msgs[1:], strict=False):
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


class FakeAnthropic(ThreadedServer):
    def __init__(self, port: int) -> None:
        self.requests: list[dict[str, Any]] = []
        super().__init__(Starlette(routes=[Route("/v1/messages", self.messages, methods=["POST"])]), port)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def messages(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.requests.append(body)
        errors = wire_errors(body)
        if errors:
            return JSONResponse({"type": "error", "error": {"type": "invalid_request_error",
                                                             "message": "; ".join(errors)}}, status_code=400)
        last = body["messages"][-1]["content"]
        if any(c.get("type") == "tool_result" for c in last):
            content = [{"type": "text", "text": f"got {len(last)} result(s)"}]
            stop = "end_turn"
        else:
            tool = body["tools"][0]["name"]
            content = [{"type": "text", "text": "let me look"},
                       {"type": "tool_use", "id": f"toolu_{len(self.requests)}", "name": tool, "input": {"q": 1}}]
            stop = "tool_use"
        cached = len(self.requests) > 1
        return JSONResponse({
            "id": f"msg_{len(self.requests)}", "type": "message", "role": "assistant", "model": body["model"],
            "content": content, "stop_reason": stop, "stop_sequence": None,
            "usage": {"input_tokens": 50, "output_tokens": 9, "cache_read_input_tokens": 400 if cached else 0,
                      "cache_creation_input_tokens": 0 if cached else 400},
        })
