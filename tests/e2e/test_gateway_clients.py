"""The drop-in gateway (SPEC §15.5) with real clients on the real stack: the official ``openai`` and ``anthropic`` SDKs
(sync and async, streamed and not), LangChain ``ChatOpenAI`` / ``ChatAnthropic`` with bound tools and
``litellm.completion``, each pointed at ctxbuild as at its provider.

Every client holds the same multi-turn conversation with its own tool, ``fetch_log``: the model (the local
wire-format server, ``[[fake: steps=2 parallel=2 readback=new]]``) calls it twice in parallel per round for two
rounds; part 1 of each round is large (over the in-flight threshold of the model's window), part 2 small. ctxbuild
serves the large outputs trimmed, offers its own ``fs_read`` beside the client's tool, and when the model reads an
output back it runs the read itself and continues server-side. What the client sees is checked (only its own tool
calls, a stream its SDK accepts, usage with cached tokens, the answer naming the chars and sha256 of what fs_read
gave back — equal to the client's own output), and what went upstream (the large outputs only as markers, the reads
there, the request smaller than the client's).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import os
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.support.auth import AUTH

pytestmark = pytest.mark.e2e

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm: no fetch of its price list at import

MODEL = "gpt-4o"  # in the default model table: an OpenAI-dialect upstream (the session's fake), a 128k window
LARGE_CHARS = 45_000  # over the 128k window's in-flight threshold (38,400 chars)
DIRECTIVE = "[[fake: steps=2 parallel=2 readback=new]]"
DESCRIPTION = "Fetch one part of a step's log."
SCHEMA = {"type": "object", "properties": {"step": {"type": "integer"}, "part": {"type": "integer"}},
          "required": ["step", "part"]}
OPENAI_TOOL = {"type": "function", "function": {"name": "fetch_log", "description": DESCRIPTION, "parameters": SCHEMA}}
ANTHROPIC_TOOL = {"name": "fetch_log", "description": DESCRIPTION, "input_schema": SCHEMA}
READBACK = re.compile(r"^readback (\S+) (\S+) chars=(\d+) sha256=([0-9a-f]{64})$", re.MULTILINE)


def log_output(label: str, large: bool) -> str:
    """A client tool's output: its first line names it (kept in a trimmed output's head)."""
    lines, n = [f"output-id: {label}"], 0
    while sum(len(x) + 1 for x in lines) < (LARGE_CHARS if large else 300):
        lines.append(f"{label} line {n:05d} ok {hashlib.sha256(f'{label}{n}'.encode()).hexdigest()[:40]}")
        n += 1
    return "\n".join(lines)


def api_key() -> str:
    return AUTH["Authorization"].removeprefix("Bearer ")


@dataclass
class Reply:
    text: str
    calls: list[tuple[str, str, dict[str, Any]]]  # (id, name, input)
    finish: str  # stop | tool_calls (Anthropic: end_turn | tool_use, normalised)
    usage: dict[str, int]  # input, output, cached
    conversation: str | None = None  # X-Ctx-Conversation-Id, where the client exposes headers


@dataclass
class Outcome:
    replies: list[Reply] = field(default_factory=list)
    outputs: dict[str, str] = field(default_factory=dict)
    served: list[list[dict[str, Any]]] = field(default_factory=list)  # per client request: the upstream bodies
    sent_chars: list[int] = field(default_factory=list)  # per client request: chars of its messages' text


# ---------------------------------------------------------------- the clients

class OpenAIChat:
    def __init__(self, base: str, *, use_async: bool, stream: bool) -> None:
        import openai

        cls = openai.AsyncOpenAI if use_async else openai.OpenAI
        self.client = cls(base_url=f"{base}/v1", api_key=api_key(), max_retries=0, timeout=120)
        self.use_async, self.stream, self.messages = use_async, stream, []

    def user(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def results(self, results: list[tuple[str, str]]) -> None:
        self.messages += [{"role": "tool", "tool_call_id": cid, "content": text} for cid, text in results]

    def size(self) -> int:
        return sum(len(m.get("content") or "") for m in self.messages)

    async def ask(self) -> Reply:
        kw: dict[str, Any] = {"model": MODEL, "messages": self.messages, "tools": [OPENAI_TOOL],
                              "parallel_tool_calls": True}
        if self.stream:
            kw.update(stream=True, stream_options={"include_usage": True})
        create = self.client.chat.completions.with_raw_response.create
        raw = await create(**kw) if self.use_async else await asyncio.to_thread(create, **kw)
        parsed = raw.parse()
        parsed = await parsed if inspect.isawaitable(parsed) else parsed  # the async response's parse is a coroutine
        cid = raw.headers.get("x-ctx-conversation-id")
        if not self.stream:
            choice = parsed.choices[0]
            msg = choice.message
            text = msg.content or ""
            calls = [(c.id, c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
            finish, usage = choice.finish_reason, parsed.usage
        else:
            chunks = [c async for c in parsed] if self.use_async else await asyncio.to_thread(list, parsed)
            text, calls, finish, usage = self.joined(chunks)
        self.messages.append({"role": "assistant", "content": text or None, **({"tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, n, a in calls]} if calls else {})})
        return Reply(text, calls, finish, {"input": usage.prompt_tokens, "output": usage.completion_tokens,
                                           "cached": usage.prompt_tokens_details.cached_tokens}, cid)

    @staticmethod
    def joined(chunks: list[Any]) -> tuple[str, list[tuple[str, str, dict[str, Any]]], str, Any]:
        """The SDK's chunks added up: one finish_reason, a usage chunk last with no choices (include_usage)."""
        text, calls, finishes = [], {}, []
        for chunk in chunks:
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
                for tc in choice.delta.tool_calls or []:
                    c = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                    c["id"] = tc.id or c["id"]
                    c["name"] += (tc.function.name or "") if tc.function else ""
                    c["arguments"] += (tc.function.arguments or "") if tc.function else ""
                if choice.finish_reason:
                    finishes.append(choice.finish_reason)
        assert len(finishes) == 1, finishes
        assert chunks[-1].choices == [] and chunks[-1].usage is not None, "the usage chunk comes last"
        return ("".join(text), [(c["id"], c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())],
                finishes[0], chunks[-1].usage)


class AnthropicChat:
    def __init__(self, base: str, *, use_async: bool, stream: bool) -> None:
        import anthropic

        cls = anthropic.AsyncAnthropic if use_async else anthropic.Anthropic
        self.client = cls(base_url=base, api_key=api_key(), max_retries=0, timeout=120)
        self.use_async, self.stream, self.messages = use_async, stream, []

    def user(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def results(self, results: list[tuple[str, str]]) -> None:
        self.messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": cid, "content": text} for cid, text in results]})

    def size(self) -> int:
        return sum(len(m["content"]) if isinstance(m["content"], str) else
                   sum(len(b.get("content") or b.get("text") or "") for b in m["content"]) for m in self.messages)

    async def ask(self) -> Reply:
        kw: dict[str, Any] = {"model": MODEL, "max_tokens": 1024, "messages": self.messages, "tools": [ANTHROPIC_TOOL]}
        if not self.stream:
            create = self.client.messages.with_raw_response.create
            raw = await create(**kw) if self.use_async else await asyncio.to_thread(create, **kw)
            msg = raw.parse()
            msg = await msg if inspect.isawaitable(msg) else msg
            cid = raw.headers.get("x-ctx-conversation-id")
        elif self.use_async:
            async with self.client.messages.stream(**kw) as s:
                async for _ in s.text_stream:
                    pass
                msg, cid = await s.get_final_message(), s.response.headers.get("x-ctx-conversation-id")
        else:
            def run() -> tuple[Any, str | None]:
                with self.client.messages.stream(**kw) as s:
                    for _ in s.text_stream:
                        pass
                    return s.get_final_message(), s.response.headers.get("x-ctx-conversation-id")
            msg, cid = await asyncio.to_thread(run)
        self.messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]})
        text = "".join(b.text for b in msg.content if b.type == "text")
        calls = [(b.id, b.name, b.input) for b in msg.content if b.type == "tool_use"]
        finish = {"end_turn": "stop", "tool_use": "tool_calls"}.get(msg.stop_reason, msg.stop_reason)
        u = msg.usage
        return Reply(text, calls, finish, {"input": u.input_tokens, "output": u.output_tokens,
                                           "cached": u.cache_read_input_tokens or 0}, cid)


class LangChainChat:
    def __init__(self, base: str, *, dialect: str, stream: bool) -> None:
        if dialect == "openai":
            from langchain_openai import ChatOpenAI

            llm = ChatOpenAI(model=MODEL, base_url=f"{base}/v1", api_key=api_key(), max_retries=0,
                             stream_usage=True)
        else:
            from langchain_anthropic import ChatAnthropic

            llm = ChatAnthropic(model=MODEL, base_url=base, api_key=api_key(), max_retries=0, max_tokens=1024)

        def fetch_log(step: int, part: int) -> str:
            """Fetch one part of a step's log."""
            raise AssertionError("the client runs its tools itself in this test")

        self.llm, self.stream, self.messages = llm.bind_tools([fetch_log]), stream, []

    def user(self, text: str) -> None:
        from langchain_core.messages import HumanMessage

        self.messages.append(HumanMessage(text))

    def results(self, results: list[tuple[str, str]]) -> None:
        from langchain_core.messages import ToolMessage

        self.messages += [ToolMessage(text, tool_call_id=cid) for cid, text in results]

    def size(self) -> int:
        return sum(len(m.content) for m in self.messages if isinstance(m.content, str))

    async def ask(self) -> Reply:
        if self.stream:
            ai = None
            async for chunk in self.llm.astream(self.messages):
                ai = chunk if ai is None else ai + chunk
        else:
            ai = await self.llm.ainvoke(self.messages)
        self.messages.append(ai)
        text = ai.content if isinstance(ai.content, str) else "".join(
            b.get("text", "") for b in ai.content if isinstance(b, dict) and b.get("type") == "text")
        meta = ai.response_metadata
        finish = meta.get("finish_reason") or {"end_turn": "stop", "tool_use": "tool_calls"}.get(
            meta.get("stop_reason"), meta.get("stop_reason"))
        u = ai.usage_metadata or {}
        return Reply(text, [(c["id"], c["name"], c["args"]) for c in ai.tool_calls], finish,
                     {"input": u.get("input_tokens", 0), "output": u.get("output_tokens", 0),
                      "cached": (u.get("input_token_details") or {}).get("cache_read", 0)})


class LiteLLMChat:
    def __init__(self, base: str) -> None:
        self.base, self.messages = f"{base}/v1", []

    user = OpenAIChat.user
    results = OpenAIChat.results
    size = OpenAIChat.size

    async def ask(self) -> Reply:
        import litellm

        r = await asyncio.to_thread(litellm.completion, model=f"openai/{MODEL}", api_base=self.base,
                                    api_key=api_key(), messages=self.messages, tools=[OPENAI_TOOL], num_retries=0)
        choice = r.choices[0]
        msg = choice.message
        calls = [(c.id, c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
        self.messages.append({"role": "assistant", "content": msg.content, **({"tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, n, a in calls]} if calls else {})})
        details = getattr(r.usage, "prompt_tokens_details", None)
        return Reply(msg.content or "", calls, choice.finish_reason,
                     {"input": r.usage.prompt_tokens, "output": r.usage.completion_tokens,
                      "cached": getattr(details, "cached_tokens", 0) or 0})


# ---------------------------------------------------------------- the conversation and its checks

def first_user_text(body: dict[str, Any]) -> str:
    for m in body["messages"]:
        if m["role"] == "user":
            c = m["content"]
            return c if isinstance(c, str) else " ".join(p.get("text", "") for p in c if isinstance(p, dict))
    return ""


async def converse(chat: Any, fake: Any) -> Outcome:
    nonce = uuid.uuid4().hex[:12]
    chat.user(f"Fetch both parts of each step's log, then tell me what they say. {DIRECTIVE} (run {nonce})")
    out = Outcome()
    for _ in range(4):
        before = len(fake.requests)
        out.sent_chars.append(chat.size())
        reply = await chat.ask()
        out.served.append([b for b in fake.requests[before:] if nonce in first_user_text(b)])
        out.replies.append(reply)
        if not reply.calls:
            break
        results = []
        for cid, _, args in reply.calls:
            label = f"s{args['step']}p{args['part']}"
            out.outputs[label] = log_output(label, large=args["part"] == 1)
            results.append((cid, out.outputs[label]))
        chat.results(results)
    return out


def served_tool_texts(body: dict[str, Any]) -> list[str]:
    return [m["content"] if isinstance(m["content"], str) else json.dumps(m["content"])
            for m in body["messages"] if m["role"] == "tool"]


def check(out: Outcome) -> None:
    replies = out.replies
    # what the client sees: two rounds of two parallel calls of its own tool, then the answer — never fs_read
    assert [len(r.calls) for r in replies] == [2, 2, 0], [(r.text, r.calls) for r in replies]
    assert {name for r in replies for _, name, _ in r.calls} == {"fetch_log"}
    assert [r.finish for r in replies] == ["tool_calls", "tool_calls", "stop"]
    assert len({cid for r in replies for cid, _, _ in r.calls}) == 4  # distinct call ids
    final = replies[-1]
    # the answer (with what the model said in the turn's server-side steps before it) proves each large output
    # was read back in full through fs_read: the pages joined back to the client's own output
    assert "done after 2 rounds and 4 results." in final.text, final.text
    got: dict[str, set[tuple[str, int, str]]] = {}
    for label, uri, chars, sha in READBACK.findall(final.text):
        got.setdefault(label, set()).add((uri, int(chars), sha))
    assert set(got) == {"s1p1", "s2p1"}, final.text  # small outputs are served whole: nothing to read back
    for label, seen in got.items():
        text = out.outputs[label]
        assert len(seen) == 1, seen
        uri, chars, sha = seen.pop()
        assert uri.startswith("context://vfs/")
        assert (chars, sha) == (len(text), hashlib.sha256(text.encode()).hexdigest()), label
    # usage on every reply, cached tokens reported (the upstream's, summed over the turn's steps)
    for r in replies:
        assert r.usage["input"] > 0 and r.usage["output"] > 0, r.usage
    assert final.usage["cached"] > 0, final.usage
    # upstream: the large outputs only as markers, the small ones whole, the reads there (and only there)
    for n in (1, 2):
        bodies = out.served[n]
        assert bodies, f"client request {n + 1} reached the upstream"
        fs_reads = [c for b in bodies for m in b["messages"] if m["role"] == "assistant"
                    for c in m.get("tool_calls") or [] if c["function"]["name"] == "fs_read"]
        assert fs_reads, "the model's read went through fs_read upstream"
        offered = {t["function"]["name"] for t in bodies[0].get("tools", [])}
        assert {"fetch_log", "fs_read"} <= offered, offered
        for b in bodies:
            for text in served_tool_texts(b):
                if text.startswith("output-id: s") and text.split("\n", 1)[0].endswith("p1"):
                    assert "<persisted-output>" in text and len(text) < 5_000, text[:200]
                elif text.startswith("output-id: s"):
                    assert text == out.outputs[text.split("\n", 1)[0].removeprefix("output-id: ")]
    # the served request stayed small: the last client request carried all four outputs whole, its first served
    # request carries them trimmed (beside it: what the model itself read back in the previous request)
    served_outputs = sum(len(t) for t in served_tool_texts(out.served[2][0]) if t.startswith("output-id: s"))
    client_outputs = sum(len(t) for t in out.outputs.values())
    assert served_outputs < client_outputs / 10, (served_outputs, client_outputs)


# ---------------------------------------------------------------- one test per client

@pytest.mark.parametrize(("use_async", "stream"), [(False, False), (False, True), (True, False), (True, True)],
                         ids=["sync", "sync-stream", "async", "async-stream"])
async def test_openai_sdk(all_services, fake_openai, use_async, stream):
    out = await converse(OpenAIChat(all_services, use_async=use_async, stream=stream), fake_openai)
    check(out)
    ids = {r.conversation for r in out.replies}
    assert len(ids) == 1 and None not in ids, ids  # one conversation, found by its message prefix


@pytest.mark.parametrize(("use_async", "stream"), [(False, False), (False, True), (True, False), (True, True)],
                         ids=["sync", "sync-stream", "async", "async-stream"])
async def test_anthropic_sdk(all_services, fake_openai, use_async, stream):
    out = await converse(AnthropicChat(all_services, use_async=use_async, stream=stream), fake_openai)
    check(out)
    ids = {r.conversation for r in out.replies}
    assert len(ids) == 1 and None not in ids, ids


async def test_langchain_chat_openai(all_services, fake_openai):
    check(await converse(LangChainChat(all_services, dialect="openai", stream=False), fake_openai))


async def test_langchain_chat_anthropic_streamed(all_services, fake_openai):
    check(await converse(LangChainChat(all_services, dialect="anthropic", stream=True), fake_openai))


async def test_litellm_completion(all_services, fake_openai):
    check(await converse(LiteLLMChat(all_services), fake_openai))
