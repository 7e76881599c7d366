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

A client-tool script (for the gateway's real-client tests and ``make bench-gateway``; :class:`Script`): when the
last user message (else the system prompt) carries ``[[fake: steps=K parallel=P readback=new|none|<label>,…]]``
the model calls the client's own tools (every offered tool that is not ctxbuild's) for K rounds of P parallel
calls (arguments ``{"step": n, "part": j}``; an output starting ``output-id: s<n>p<j>`` marks round n done);
with ``readback`` it first reads back, through ``fs_read`` page by page, each trimmed output (its
``<persisted-output>`` URI) it was asked for — ``new``: those since the user message, ``<label>``: the client
tool result holding ``output-id: <label>``, ``context://…``: that URI — and its answer names, per output read, the
chars and sha256 of the text the pages joined back to, so a test proves the full text came back. Without the
directive nothing changes. ``GET /_recorded?since=n`` returns the recorded bodies (for a server in a subprocess:
``python -m tests.support.fake_openai --port N``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import re
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
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


DIRECTIVE = re.compile(r"\[\[fake: ([^\]]*)\]\]")
FULL_OUTPUT = re.compile(r"Full output: (\S+)")
STEP_LABEL = re.compile(r"output-id: s(\d+)p\d+\n")
TOTALS = re.compile(r"\((\d+) lines, (\d+) chars total")
PAGE_CHARS = 40_000  # under fs_read's 50,000-char page cap with the line numbers
URI_PAGE_LINES = 200  # a page of an output whose marker (its totals) is not in view
PAGE_LINE = re.compile(r"^ *\d+\t", re.MULTILINE)
MORE = re.compile(r"\n\n\[showing lines \d+-(\d+) of \d+; \d+ more — call again with offset=\d+ to continue\]$")
# the tools ctxbuild offers beside the client's: never called as "the client's tools"
CTX_TOOLS = frozenset({"read_file", "fs_read", "web_fetch", "web_search", "tool_search", "tool_inspect", "tool_invoke"})


@dataclass
class Turn:
    """One message of a conversation in either wire format, reduced to what the script reads."""

    role: str  # user | assistant | tool
    text: str = ""
    calls: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)  # (id, name, input)
    results: list[tuple[str, str]] = field(default_factory=list)  # (tool call id, text)


def readback_line(label: str, uri: str, text: str) -> str:
    return f"readback {label} {uri} chars={len(text)} sha256={hashlib.sha256(text.encode()).hexdigest()}"


@dataclass
class Script:
    """The deterministic client-tool model behind ``[[fake: …]]`` (see the module docstring)."""

    steps: int = 0
    parallel: int = 1
    readback: tuple[str, ...] = ()

    @classmethod
    def of(cls, turns: list[Turn]) -> tuple[Script, int] | None:
        """The directive of the last user message and that message's index, or None (no script)."""
        users = [i for i, t in enumerate(turns) if t.role == "user"]
        found = DIRECTIVE.search(turns[users[-1]].text) if users else None
        # else the system prompt's: a client's system prompt is served every step, while a long conversation's
        # first user message may be folded away by compaction
        for t in turns:
            if found is None and t.role == "system":
                found = DIRECTIVE.search(t.text)
        if found is None:
            return None
        opts = dict(kv.split("=", 1) for kv in found.group(1).split() if "=" in kv)
        rb = tuple(x for x in opts.get("readback", "none").split(",") if x and x != "none")
        return cls(int(opts.get("steps", 0)), int(opts.get("parallel", 1)), rb), users[-1] if users else -1

    def decide(self, turns: list[Turn], at: int, tools: list[str]) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
        """(text, calls): the calls to make now (empty → ``text`` is the answer)."""
        since = turns[at + 1:]
        calls = {cid: (name, args) for t in turns for cid, name, args in t.calls}
        done = list(dict.fromkeys(line for t in since if t.role == "assistant" for line in t.text.splitlines()
                                  if line.startswith("readback ")))
        said = len(done)  # an assistant text says what is new; the answer says it all
        if "fs_read" in tools and self.readback:
            # the outputs asked for: (label, uri) of the client's tool results that carry a trim marker
            wanted: list[tuple[str, str, int]] = []
            for t in since if "new" in self.readback else turns:
                for cid, text in t.results:
                    if calls.get(cid, ("",))[0] in CTX_TOOLS:
                        continue
                    label = m.group(1) if (m := re.search(r"output-id: (\S+)", text)) else cid
                    if "new" in self.readback or label in self.readback:
                        totals = TOTALS.search(text)
                        lines, chars = (int(totals.group(1)), int(totals.group(2))) if totals else (1, 1)
                        limit = max(1, PAGE_CHARS * lines // (chars + 8 * lines))
                        wanted += [(label, uri, limit) for uri in FULL_OUTPUT.findall(text)]
            # a URI asked for by name: read even when the output it came from is folded out of view
            wanted += [(uri, uri, URI_PAGE_LINES) for uri in self.readback if uri.startswith("context://")]
            for label, uri, limit in wanted:
                if any(line.startswith(f"readback {label} {uri} ") for line in done):
                    continue
                pages = [text for t in since for cid, text in t.results
                         if calls.get(cid, ("",))[0] == "fs_read" and calls[cid][1].get("uri") == uri]
                joined, offset = self.joined(pages)
                if offset is not None:  # (more) to read
                    args = {"uri": uri, "offset": offset, "limit": limit}
                    return "\n".join(done[said:]), [("fs_read", args)]
                # said in the next assistant text, so later steps (their requests carry it) know it is read
                done.append(readback_line(label, uri, joined))
        return self._next(turns, at, tools, done, said)

    def _next(self, turns: list[Turn], at: int, tools: list[str], done: list[str],
              said: int = 0) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
        since = turns[at + 1:]
        calls = {cid: name for t in turns for cid, name, _ in t.calls}
        mine = [n for n in tools if n not in CTX_TOOLS]
        rounds = sum(1 for t in since if t.role == "assistant" and any(calls[c] in mine for c, _, _ in t.calls))
        # outputs named s<step>p<part> say their round even when earlier rounds are folded out of view
        rounds = max([rounds, *(int(m.group(1)) for t in since for _, text in t.results
                                if (m := STEP_LABEL.match(text)))])
        if mine and rounds < self.steps:
            return "\n".join(done[said:]), [(mine[(rounds * self.parallel + j) % len(mine)],
                                      {"step": rounds + 1, "part": j + 1}) for j in range(self.parallel)]
        results = sum(1 for t in since for cid, _ in t.results if calls.get(cid) in mine)
        return "\n".join([f"done after {rounds} rounds and {results} results.", *done]), []

    @staticmethod
    def joined(pages: list[str]) -> tuple[str, int | None]:
        """The text fs_read's pages join back to, and the next offset to read (None: complete)."""
        body, offset = [], 1
        for page in pages:
            more = MORE.search(page)
            text = page[:more.start()] if more else page
            body.append(PAGE_LINE.sub("", text))
            if not more:
                return "\n".join(body), None
            offset = int(more.group(1)) + 1
        return "\n".join(body), offset


def openai_turns(messages: list[dict[str, Any]]) -> list[Turn]:
    def text(content: Any) -> str:
        if isinstance(content, list):
            return "".join(c.get("text", "") for c in content if isinstance(c, dict))
        return content or ""

    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append(Turn("tool", results=[(m["tool_call_id"], text(m.get("content")))]))
        elif m["role"] in ("system", "developer"):
            out.append(Turn("system", text(m.get("content"))))
        elif m["role"] in ("user", "assistant"):
            out.append(Turn(m["role"], text(m.get("content")), [
                (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"] or "{}"))
                for c in m.get("tool_calls") or []]))
    return out


class FakeOpenAI(ThreadedServer):
    def __init__(self, port: int) -> None:
        self.requests: list[dict[str, Any]] = []
        self.fail_next: int | None = None  # HTTP status to answer the next request with
        self.reply_next: dict[str, Any] | None = None
        self.break_next: str | None = None
        self.delay_next_s: float = 0.0  # wait this long before answering the next request (a slow model)
        self.hold_next: threading.Event | None = None  # the next request waits until the test sets it
        super().__init__(Starlette(routes=[Route("/v1/chat/completions", self.completions, methods=["POST"]),
                                           Route("/_recorded", self.recorded)]), port)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def recorded(self, request: Request) -> Response:
        return JSONResponse(self.requests[int(request.query_params.get("since", 0)):])

    def scripted(self, body: dict[str, Any]) -> dict[str, Any] | None:
        turns = openai_turns(body["messages"])
        found = Script.of(turns)
        if found is None:
            return None
        script, at = found
        text, calls = script.decide(turns, at, [t["function"]["name"] for t in body.get("tools", [])])
        if not calls:
            return {"role": "assistant", "content": text}
        n = len(self.requests)
        return {"role": "assistant", "content": text or None, "tool_calls": [
            {"id": f"call_{n}_{j}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            for j, (name, args) in enumerate(calls)]}

    def decide(self, body: dict[str, Any]) -> dict[str, Any]:
        scripted = self.scripted(body)
        if scripted is not None:
            return scripted
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


if __name__ == "__main__":  # a server in its own process (bench/gateway.py's upstream)
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    port = parser.parse_args().port
    server = FakeOpenAI(port)
    server.server.run()
