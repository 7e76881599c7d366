"""Context-quality benchmark (`make bench-context` → bench/results/context.json + bench/results/context-*.png):
ctxbuild's served requests beside other context strategies on the same recorded agent runs, by the metrics of
docs CONTEXT_METRICS.md (shared/docs; computed in bench/context_metrics.py).

Runs: every recorded run in ../shared/data/trajectories/ of the four formats — SWE-agent ``.traj``,
mini-swe-agent ``.traj.json``, tau-bench episode lists (one run per episode) and STORM web-research folders
(``conversation_log.json``) — whatever their number; anything else is listed under ``skipped`` with the reason
(e.g. the Claude Code transcript: Anthropic content blocks with a ``/compact`` boundary, i.e. a run that was
already compacted by its own harness, not one of the four formats). Windows W = 32,000 and 16,000.

Full history: the run's messages with every tool output in full, as the replay loaders of
ctxbuild_providers.trajectories (and bench/e2e_metrics.storm_turns) read them: one user message per turn, each
model call an assistant message (text, tool calls with the recorded ids, else ``call_<turn>_<step>_<i>``), each
output a tool message.
mini-swe-agent outputs are ``extra.raw_output`` rendered through the run's ``observation_template`` with its
10,000-char cut disabled. Every strategy gets the same system message: the one ctxbuild serves (ctxbuild cannot
be given the run's own system prompt, so nobody is).

Strategies:
- ctxbuild/<summarizer> for extractive, masking and llm: a private stack (libs/devstack), one conversation per
  run, window and summarizer (settings ``contextWindow``, ``summarizer``), each turn replayed through the edge
  (replay provider, recorded decisions and FULL outputs). Requests are the real served ones
  (GET …/steps/{n}/request), converted with the product's OpenAI adapter (``to_wire_messages``); replayed call
  ids are mapped back to the recorded ones (``call_<turn>_<step>_<i>`` where a run has none). The llm summarizer
  talks to a deterministic local stand-in speaking OpenAI's wire format (its ``<summary>`` is ~10% of its input,
  200..800 tokens, made of lines of the input); its input and output tokens (cl100k, same counter) go into
  cache_adjusted_cost at 1.25. Links: every ``context://vfs/…`` URI in the last request, read back through
  ``ctx.blob.fs_read`` over NATS (paged, conversation scope); a link counts only if it reads back.
- peers through their own library code: raw; lc_trim (``trim_messages``); lc_clear_default and lc_clear_0.8W
  (``ContextEditingMiddleware.wrap_model_call``); deepagents_evict and deepagents_evict_2500
  (``FilesystemMiddleware(backend=FilesystemBackend(virtual_mode=True)).wrap_tool_call`` on each new tool result;
  links = stored paths in the last request, read back from the backend).
Compaction between steps (for prefix_stability_outside_compaction): ctxbuild — a CompactionDecided or
InLoopFoldRecorded at the step (a turn-start fold for a turn's first step); lc_trim — the first kept message
moved; lc_clear — the set of cleared results changed; deepagents — never (it only replaces a new result).

    .venv/bin/python bench/context.py --out bench/results/context.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from context_metrics import (
    GATED,
    StrategyRun,
    TokenCounter,
    add_ratios,
    content_text,
    find_links,
    has_task,
    match_recorded_ids,
    request_texts,
    strategy_metrics,
    uncut_template,
    worst_case,
)

ROOT = Path(__file__).resolve().parents[1]
TRAJ = ROOT.parent / "shared" / "data" / "trajectories"
WINDOWS = (32_000, 16_000)
SUMMARIZERS = ("extractive", "masking", "llm")
PEERS = ("raw", "lc_trim", "lc_clear_default", "lc_clear_0.8W", "deepagents_evict", "deepagents_evict_2500")
TURN_TIMEOUT_S = 600.0
STAND_IN_MODEL = "bench-stand-in-summarizer"
MAX_LINK_READS = 400
READ_RETRIES = 3

DEFINITIONS = {
    "steps_over_window": "requests whose tokens exceed W (request tokens = 3 + Σ per message (3 + role + content "
                         "+ name + tool_call_id + each call's id, name and arguments), cl100k, no tool schemas)",
    "no_task_steps": "requests with no user message containing the run's first user message (the task) verbatim",
    "orphan_steps": "requests with a tool result lacking its assistant tool call, or a call with no result before "
                    "the next non-tool message or the end",
    "prefix_stability": "share of steps k >= 2 whose request starts with exactly request k-1's messages (deep "
                        "equality)",
    "prefix_stability_outside_compaction": "the same over the steps where the strategy did not compact between "
                                           "k-1 and k",
    "cache_adjusted_cost": "Σ_k 0.1 × tokens of the longest common message prefix with request k-1 + 1.25 × the "
                           "rest (step 1 all at 1.25), plus the strategy's own LLM tokens (summarizer input and "
                           "output) at 1.25",
    "model_recoverable": "at the last step, the share of all tool-output characters of the run present verbatim "
                         "in the request or in the full texts read back behind links in it that the strategy "
                         "really stored (ctxbuild: context://vfs/ URIs via ctx.blob.fs_read): a character counts "
                         "when a 32-char window of its output (at any offset) containing it is found anywhere; "
                         "model_recoverable_aligned_windows: consecutive non-overlapping windows only",
    "cost_ratio_vs_best_peer": "cache_adjusted_cost / that of the cheapest peer with no_task_steps 0 and "
                               "model_recoverable >= 0.99 on the same run and window; only runs whose raw history "
                               "exceeds W at some step (null: no peer qualifies)",
    "cost_ratio_vs_raw": "cache_adjusted_cost / raw's, for runs whose raw history never exceeds W",
    "/default/": "the worst value over all runs and windows for ctxbuild's default summarizer "
                 "(cost_ratio_vs_best_peer over the runs exceeding W, cost_ratio_vs_raw over the others)",
}


NOTES = [
    ("Links are read back after the run's last turn has ended (conversation scope, ctx.blob.fs_read). A blob held "
    "only by a provisional reference of a turn (the masking summarizer's archived outputs) is released when that "
    "turn ends, so it reads back as access-denied here; within a single-turn run the model could still have read "
    "it during its last step, across turns it could not."),
    ("A link found inside a read-back text is followed too (one more fs_read for the model), up to "
    f"{MAX_LINK_READS} reads per cell."),
    ("Every strategy is given the system message ctxbuild served at its first step; recorded system prompts are "
    "not replayed (ctxbuild cannot be given them). Call ids are the recorded ones (call_<turn>_<step>_<i> where a "
    "run has none) for every strategy."),
    ("32-char windows are compared verbatim: an output shown in another JSON layout (e.g. with ', ' separators) "
    "only counts where its windows still match."),
]


# ---------------------------------------------------------------- runs

@dataclass
class Run:
    name: str
    format: str
    tools: list[dict[str, Any]]
    turns: list[tuple[str, list[dict[str, Any]]]]  # (user text, replay script with recorded outputs)
    messages: list[dict[str, Any]] = field(default_factory=list)  # full history, wire form, no system
    step_at: list[int] = field(default_factory=list)  # index in messages of the k-th assistant message
    outputs: list[str] = field(default_factory=list)  # every tool output of the run, as shown to the model
    recorded_ids: list[str] = field(default_factory=list)  # the run's own call ids, in call order (if complete)

    def call_id(self, turn: int, step: int, i: int) -> str:
        """The recorded id of call i of step ``step`` of turn ``turn`` (all 1-based but turn), else
        ``call_<turn>_<step>_<i>``."""
        if self.recorded_ids:
            if self._order is None:
                self._order = {(j, k, n): x for x, (j, k, n) in enumerate(
                    (j, k, n) for j, (_, script) in enumerate(self.turns)
                    for k, st in enumerate(script, 1) for n in range(1, len(st.get("toolCalls") or []) + 1))}
            return self.recorded_ids[self._order[(turn, step, i)]]
        return canonical_id(turn, step, i)

    _order: dict[tuple[int, int, int], int] | None = None

    @property
    def task(self) -> str:
        return self.turns[0][0]


def output_text(output: dict[str, Any]) -> str:
    from ctxbuild_providers.openai_chat import output_text as wire_text

    return wire_text(output)


def canonical_id(turn: int, step: int, i: int) -> str:
    return f"call_{turn + 1}_{step}_{i}"


def build_history(run: Run) -> None:
    """The full history in OpenAI chat form and where each step's request ends."""
    msgs: list[dict[str, Any]] = []
    for j, (text, script) in enumerate(run.turns):
        msgs.append({"role": "user", "content": text})
        for k, step in enumerate(script, 1):
            run.step_at.append(len(msgs))
            a: dict[str, Any] = {"role": "assistant", "content": step.get("text") or None}
            calls = step.get("toolCalls") or []
            if calls:
                a["tool_calls"] = [{"id": run.call_id(j, k, i), "type": "function", "function": {
                    "name": c["toolName"],
                    "arguments": json.dumps(c.get("input", {}), ensure_ascii=False, separators=(",", ":"))}}
                    for i, c in enumerate(calls, 1)]
            msgs.append(a)
            for i, c in enumerate(calls, 1):
                if "output" in c:
                    text_out = output_text(c["output"])
                    run.outputs.append(text_out)
                    msgs.append({"role": "tool", "tool_call_id": run.call_id(j, k, i), "content": text_out})
    run.messages = msgs


def mini_swe_full_outputs(path: Path, run: Run) -> None:
    """Replace each recorded raw output with the run's observation_template rendering of it, cut disabled."""
    import jinja2

    doc = json.loads(path.read_text(encoding="utf-8"))
    cfg = ((doc.get("info") or {}).get("config") or {})
    template = ((cfg.get("model") or {}).get("observation_template")
                or (cfg.get("agent") or {}).get("observation_template"))
    if not template:
        return
    tpl = jinja2.Environment(undefined=jinja2.ChainableUndefined).from_string(uncut_template(template))
    rendered: list[tuple[str, str]] = []
    for m in doc["messages"]:
        extra = m.get("extra")
        if isinstance(extra, dict) and isinstance(extra.get("raw_output"), str):
            out = {"output": extra["raw_output"], "returncode": extra.get("returncode"),
                   "exception_info": extra.get("exception_info") or ""}
            rendered.append((extra["raw_output"], tpl.render(output=out)))
    it = iter(rendered)
    pending = next(it, None)
    for _, script in run.turns:
        for step in script:
            for c in step.get("toolCalls") or []:
                o = c.get("output")
                if pending is not None and o and o.get("value") == pending[0]:
                    c["output"] = {"type": "text", "value": pending[1]}
                    pending = next(it, None)


def recorded_calls(path: Path, fmt: str, episode: int) -> list[tuple[str, str, Any]]:
    """(id, tool name, arguments) of the calls a run recorded, in order (demonstrations skipped)."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    msgs = doc[episode]["traj"] if fmt == "tau-bench" else doc.get("history") if fmt == "swe-agent" \
        else doc.get("messages")
    out: list[tuple[str, str, Any]] = []
    for m in msgs or []:
        if m.get("role") == "assistant" and not m.get("is_demo"):
            for c in m.get("tool_calls") or []:
                fn = c.get("function") or {}
                args = fn.get("arguments")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError:
                    pass
                out.append((c.get("id") or "", fn.get("name") or "", args))
    return out


def attach_recorded_ids(run: Run, recorded: list[tuple[str, str, Any]]) -> None:
    calls = [(c["toolName"], c.get("input", {})) for _, script in run.turns for st in script
             for c in st.get("toolCalls") or []]
    run.recorded_ids = match_recorded_ids(calls, recorded) or []


def discover(root: Path) -> tuple[list[Run], list[dict[str, str]]]:
    from ctxbuild_providers.trajectories import TrajectoryError, episode_count, load_trajectory
    from e2e_metrics import WEB_SEARCH_TOOL, storm_turns

    runs: list[Run] = []
    skipped: list[dict[str, str]] = []
    for path in sorted(root.iterdir()):
        if path.is_dir():
            log = path / "conversation_log.json"
            if not log.is_file():
                skipped.append({"path": path.name, "reason": "a folder without conversation_log.json"})
                continue
            turns, _ = storm_turns(json.loads(log.read_text(encoding="utf-8")))
            if turns:
                runs.append(Run(path.name, "storm-websearch", [WEB_SEARCH_TOOL], turns))
            else:
                skipped.append({"path": path.name, "reason": "STORM log with no searched dialogue turn"})
            continue
        try:
            n = episode_count(path)
            for e in range(n):
                t = load_trajectory(path, e)
                run = Run(t.name, t.format, t.tools, [(x.text, x.script) for x in t.turns])
                if t.format == "mini-swe-agent":
                    mini_swe_full_outputs(path, run)
                attach_recorded_ids(run, recorded_calls(path, t.format, e))
                if run.turns:
                    runs.append(run)
        except TrajectoryError as exc:
            reason = str(exc).split(": ", 1)[-1]
            if path.suffix == ".jsonl":
                reason += ("; a JSON-lines session transcript (e.g. Claude Code's: Anthropic content blocks, "
                           "possibly with its own /compact boundary, so no full history) is not one of the four "
                           "formats of CONTEXT_METRICS.md")
            skipped.append({"path": path.name, "reason": reason})
    for r in runs:
        build_history(r)
    return runs, skipped


# ---------------------------------------------------------------- peers (their own library code)

class Peers:
    def __init__(self, tokens: TokenCounter) -> None:
        from langchain_core.messages import convert_to_openai_messages  # noqa: F401 (fail early if absent)

        self.tokens = tokens
        self._wire: dict[int, tuple[Any, dict[str, Any]]] = {}

    # LangChain messages ⇄ the wire form every strategy is measured in
    @staticmethod
    def to_lc(m: dict[str, Any]):
        from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

        role = m["role"]
        if role == "system":
            return SystemMessage(content=m["content"])
        if role == "user":
            return HumanMessage(content=m["content"])
        if role == "assistant":
            calls = [{"name": c["function"]["name"], "args": json.loads(c["function"]["arguments"]),
                      "id": c["id"], "type": "tool_call"} for c in m.get("tool_calls") or []]
            return AIMessage(content=m["content"] or "", tool_calls=calls)
        return ToolMessage(content=m["content"], tool_call_id=m["tool_call_id"])

    @staticmethod
    def to_wire(msg) -> dict[str, Any]:
        from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

        if isinstance(msg, SystemMessage):
            return {"role": "system", "content": content_text(msg.content)}
        if isinstance(msg, HumanMessage):
            return {"role": "user", "content": content_text(msg.content)}
        if isinstance(msg, AIMessage):
            out: dict[str, Any] = {"role": "assistant", "content": content_text(msg.content) or None}
            if msg.tool_calls:
                out["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                    "name": c["name"], "arguments": json.dumps(c["args"], ensure_ascii=False, separators=(",", ":"))}}
                    for c in msg.tool_calls]
            return out
        if isinstance(msg, ToolMessage):
            return {"role": "tool", "tool_call_id": msg.tool_call_id, "content": content_text(msg.content)}
        raise TypeError(type(msg))

    def wire(self, msg) -> dict[str, Any]:
        """to_wire, memoised on the message object (trim_messages counts the same messages many times)."""
        hit = self._wire.get(id(msg))
        if hit is None or hit[0] is not msg:
            hit = (msg, self.to_wire(msg))
            self._wire[id(msg)] = hit
        return hit[1]

    def lc_counter(self, messages) -> int:
        return self.tokens.request([self.wire(m) for m in messages])

    def run(self, name: str, run: Run, system: dict[str, Any], window: int) -> StrategyRun:
        return getattr(self, "_" + name.replace(".", "_"))(run, system, window)

    def _raw(self, run: Run, system: dict[str, Any], window: int) -> StrategyRun:
        reqs = [[system, *run.messages[:i]] for i in run.step_at]
        return StrategyRun(reqs, [False] * len(reqs))

    def _lc_trim(self, run: Run, system: dict[str, Any], window: int) -> StrategyRun:
        from langchain_core.messages import trim_messages

        lc = [self.to_lc(system), *(self.to_lc(m) for m in run.messages)]
        index = {id(m): n for n, m in enumerate(lc)}
        reqs, compacted, first_kept = [], [], None
        for i in run.step_at:
            kept = trim_messages(lc[:i + 1], max_tokens=int(0.8 * window), strategy="last",
                                 token_counter=self.lc_counter, include_system=True, start_on="human",
                                 allow_partial=False)
            wire = [self.wire(m) for m in kept]
            first = index.get(id(kept[1])) if len(kept) > 1 else None
            compacted.append(first_kept is not None and first != first_kept)
            first_kept = first
            reqs.append(wire)
        return StrategyRun(reqs, compacted)

    def _clear(self, run: Run, system: dict[str, Any], middleware) -> StrategyRun:
        from langchain.agents.middleware.types import ModelRequest, ModelResponse
        from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
        from langchain_core.messages import AIMessage

        model = GenericFakeChatModel(messages=iter(()))
        sys_lc = self.to_lc(system)
        lc = [self.to_lc(m) for m in run.messages]
        reqs, compacted, prev_cleared = [], [], None
        for i in run.step_at:
            seen: list[Any] = []

            def handler(req, seen=seen):
                seen.append(req.messages)
                return ModelResponse(result=[AIMessage(content="")])

            middleware.wrap_model_call(ModelRequest(model=model, messages=lc[:i], system_message=sys_lc), handler)
            edited = seen[0]
            cleared = {m.tool_call_id for m in edited if getattr(m, "response_metadata", {})
                       .get("context_editing", {}).get("cleared")}
            compacted.append(prev_cleared is not None and cleared != prev_cleared)
            prev_cleared = cleared
            reqs.append([system, *(self.to_wire(m) for m in edited)])
        return StrategyRun(reqs, compacted)

    def _lc_clear_default(self, run: Run, system: dict[str, Any], window: int) -> StrategyRun:
        from langchain.agents.middleware import ContextEditingMiddleware

        return self._clear(run, system, ContextEditingMiddleware())

    def _lc_clear_0_8W(self, run: Run, system: dict[str, Any], window: int) -> StrategyRun:
        from langchain.agents.middleware import ClearToolUsesEdit, ContextEditingMiddleware

        return self._clear(run, system, ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger=int(0.8 * window))],
                                                                 token_counter=self.lc_counter))

    def _evict(self, run: Run, system: dict[str, Any], limit: int | None) -> StrategyRun:
        from deepagents.backends import FilesystemBackend
        from deepagents.middleware.filesystem import FilesystemMiddleware
        from langchain_core.messages import ToolMessage
        from langgraph.prebuilt.tool_node import ToolCallRequest

        with tempfile.TemporaryDirectory(prefix="bench-context-deepagents-") as root:
            backend = FilesystemBackend(root_dir=root, virtual_mode=True)
            mw = FilesystemMiddleware(backend=backend) if limit is None else \
                FilesystemMiddleware(backend=backend, tool_token_limit_before_evict=limit)
            state: list[Any] = []  # the agent's messages as they enter its state
            names: dict[str, str] = {}
            reqs: list[list[dict[str, Any]]] = []
            k = 0
            for n, m in enumerate(run.messages):
                if k < len(run.step_at) and run.step_at[k] == n:
                    reqs.append([system, *(self.to_wire(x) for x in state)])
                    k += 1
                if m["role"] == "tool":
                    tc = {"name": names[m["tool_call_id"]], "args": {}, "id": m["tool_call_id"], "type": "tool_call"}
                    request = ToolCallRequest(tool_call=tc, tool=None, state={"messages": list(state)}, runtime=None)
                    result = mw.wrap_tool_call(request, lambda _r, m=m, tc=tc: ToolMessage(
                        content=m["content"], tool_call_id=m["tool_call_id"], name=tc["name"]))
                    state.append(result)
                else:
                    msg = self.to_lc(m)
                    for c in m.get("tool_calls") or []:
                        names[c["id"]] = c["function"]["name"]
                    state.append(msg)
            last = reqs[-1] if reqs else []
            stored = [f"/{q.relative_to(root).as_posix()}" for q in Path(root).rglob("*") if q.is_file()]
            texts = request_texts(last)
            links = [p for p in stored if any(p in t for t in texts)]
            readback: list[str] = []
            unreadable = 0
            for p in links:
                got = backend.download_files([p])[0]
                if getattr(got, "error", None) or got.content is None:
                    unreadable += 1
                else:
                    readback.append(got.content.decode("utf-8", errors="replace"))
        return StrategyRun(reqs, [False] * len(reqs), readback=readback, links=len(links),
                           links_unreadable=unreadable)

    def _deepagents_evict(self, run: Run, system: dict[str, Any], window: int) -> StrategyRun:
        return self._evict(run, system, None)

    def _deepagents_evict_2500(self, run: Run, system: dict[str, Any], window: int) -> StrategyRun:
        return self._evict(run, system, 2500)


# ---------------------------------------------------------------- the llm summarizer's stand-in model

class StandIn:
    """A deterministic model speaking OpenAI's chat-completions wire format (plain and streamed): it answers a
    ``<summary>`` of about a tenth of its input tokens (200..800), made of evenly spaced lines of its input.
    Counts the tokens it was sent and answered (same cl100k counter)."""

    def __init__(self, tokens: TokenCounter) -> None:
        self.tokens = tokens
        self.input_tokens = self.output_tokens = self.calls = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))
                text, n_in, n_out = outer.answer(body)
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream")
                    self.end_headers()
                    base = {"id": "standin", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}
                    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": text},
                                                    "finish_reason": None}]},
                              {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                              {**base, "choices": [], "usage": {"prompt_tokens": n_in, "completion_tokens": n_out,
                                                                "total_tokens": n_in + n_out}}]
                    for c in chunks:
                        self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
                    self.wfile.write(b"data: [DONE]\n\n")
                    return
                payload = json.dumps({"id": "standin", "object": "chat.completion", "created": 0,
                                      "model": body["model"],
                                      "choices": [{"index": 0, "finish_reason": "stop",
                                                   "message": {"role": "assistant", "content": text}}],
                                      "usage": {"prompt_tokens": n_in, "completion_tokens": n_out,
                                                "total_tokens": n_in + n_out}}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def answer(self, body: dict[str, Any]) -> tuple[str, int, int]:
        msgs = body.get("messages") or []
        n_in = self.tokens.request(msgs)
        budget = max(200, min(800, n_in // 10))
        lines = [ln.strip() for m in msgs if m.get("role") != "system"
                 for ln in content_text(m.get("content")).splitlines() if ln.strip()]
        picked: list[str] = []
        if lines:
            step = max(1, len(lines) // max(1, budget // 12))
            for ln in lines[::step]:
                picked.append("- " + ln[:160])
                if self.tokens.count("\n".join(picked)) >= budget:
                    break
        text = "<analysis>stand-in</analysis>\n<summary>\n" + "\n".join(picked) + "\n</summary>"
        n_out = self.tokens.count(text)
        with self.lock:
            self.calls += 1
            self.input_tokens += n_in
            self.output_tokens += n_out
        return text, n_in, n_out

    def snapshot(self) -> tuple[int, int, int]:
        with self.lock:
            return self.calls, self.input_tokens, self.output_tokens

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---------------------------------------------------------------- ctxbuild through a private stack

VFS_LINK = None  # compiled lazily from the codec's scheme


def vfs_pattern() -> re.Pattern[str]:
    from ctxbuild_codec.trim import VFS_SCHEME

    return re.compile(re.escape(VFS_SCHEME) + r"[A-Za-z0-9_.\-]+")


class Ctxbuild:
    def __init__(self, base: str, api_key: str, nats_url: str, tokens: TokenCounter, stand_in: StandIn) -> None:
        import httpx

        self.http = httpx.AsyncClient(base_url=base, timeout=120, headers={"Authorization": f"Bearer {api_key}"})
        self.nats_url = nats_url
        self.tokens = tokens
        self.stand_in = stand_in
        self.broker = None
        self.rpc = None
        self.pattern = vfs_pattern()

    async def start(self) -> None:
        from ctxbuild_platform.rpc import RpcClient
        from faststream.nats import NatsBroker

        self.broker = NatsBroker(self.nats_url, logger=None)
        await self.broker.connect()
        self.rpc = RpcClient(self.broker, default_timeout=60.0)

    async def close(self) -> None:
        await self.http.aclose()
        if self.broker is not None:
            await self.broker.stop()

    async def _json(self, method: str, url: str, **kw) -> Any:
        r = await self.http.request(method, url, **kw)
        if r.status_code >= 400:
            raise RuntimeError(f"{method} {url}: HTTP {r.status_code} {r.text[:500]}")
        return r.json()

    async def wait(self, cid: str, tid: str) -> dict[str, Any]:
        deadline = time.monotonic() + TURN_TIMEOUT_S
        delay = 0.05
        while True:
            log = await self._json("GET", f"/v1/conversations/{cid}/turns/{tid}")
            if log["status"] in ("completed", "failed"):
                return log
            if time.monotonic() > deadline:
                raise TimeoutError(f"turn {tid} still {log['status']} after {TURN_TIMEOUT_S}s")
            await asyncio.sleep(delay)
            delay = min(0.5, delay * 1.5)

    async def replay(self, run: Run, window: int, summarizer: str, progress, task) -> tuple[StrategyRun, dict]:
        from ctxbuild_providers.openai_chat import to_wire_messages

        c0 = self.stand_in.snapshot()
        settings = {"contextWindow": window, "summarizer": summarizer}
        if summarizer == "llm":
            settings["summarizerModel"] = STAND_IN_MODEL
        cid = (await self._json("POST", "/v1/conversations", json={"title": f"bench-context {run.name}",
                                                                    "settings": settings}))["id"]
        reqs: list[list[dict[str, Any]]] = []
        compacted: list[bool] = []
        idmap: dict[str, str] = {}
        decisions: dict[str, int] = {}
        failed: list[dict[str, Any]] = []
        last_turn = None
        raw_by_step: list[dict[str, Any]] = []
        turn_start: list[str] = []  # each turn's turn-start decision, in order
        for j, (text, script) in enumerate(run.turns):
            provider = {"kind": "replay", "script": script, "tools": run.tools}
            r = await self.http.post(f"/v1/conversations/{cid}/turns",
                                     json={"text": text, "provider": provider, "maxSteps": len(script)})
            if r.status_code != 202:
                raise RuntimeError(f"turn refused ({r.status_code}): {r.text[:500]}")
            tid = r.json()["turnId"]
            last_turn = tid
            log = await self.wait(cid, tid)
            events = log["events"]
            if log["status"] != "completed":
                failed.append({"turn": j, "error": log.get("error")})
            folded: set[int] = set()
            start_fold = False
            for e in events:
                d = e["data"]
                if e["type"] == "CompactionDecided":
                    key = f"{d.get('phase')}:{d.get('status')}:{d.get('summarizer') or d.get('reason')}"
                    decisions[key] = decisions.get(key, 0) + 1
                    if isinstance(d.get("step"), int):
                        folded.add(d["step"])
                    elif d.get("phase") == "turn-start":
                        turn_start.append(f"{d.get('status')}:{d.get('summarizer') or d.get('reason')}")
                        start_fold = start_fold or d.get("status") == "done"
                elif e["type"] == "InLoopFoldRecorded" and isinstance(d.get("step"), int):
                    folded.add(d["step"])
                elif e["type"] == "StepServed":
                    calls = [p for p in (d.get("assistantMessage") or {}).get("parts") or []
                             if p.get("type") == "tool-call"]
                    for i, p in enumerate(calls, 1):
                        idmap[p["toolCallId"]] = run.call_id(j, d["step"], i)
            steps = sorted(e["data"]["step"] for e in events if e["type"] == "StepServed")
            for k in steps:
                body = json.loads((await self.http.get(
                    f"/v1/conversations/{cid}/turns/{tid}/steps/{k}/request")).content)
                raw_by_step.append(body)
                compacted.append(k in folded or (k == 1 and start_fold))
                progress.advance(task)
        for body in raw_by_step:
            wire = to_wire_messages(body.get("system") or "", body["messages"])
            for m in wire:
                if m.get("tool_call_id") in idmap:
                    m["tool_call_id"] = idmap[m["tool_call_id"]]
                for c in m.get("tool_calls") or []:
                    c["id"] = idmap.get(c["id"], c["id"])
            reqs.append(wire)
        # links in the last request, read back through the product
        readback: list[str] = []
        unreadable: list[str] = []
        links = find_links(request_texts(reqs[-1]), self.pattern) if reqs else []
        # a link inside a text read back (a fold's transcript names the outputs it holds as markers) is one more
        # fs_read for the model: followed too, breadth-first, up to MAX_LINK_READS reads
        queue, seen, nested, retried = list(links), set(links), 0, 0
        while queue and len(readback) + len(unreadable) < MAX_LINK_READS:
            uri = queue.pop(0)
            text, err = await self.read_back(cid, uri)
            for _ in range(READ_RETRIES):
                if text is not None:
                    break
                # references are recorded asynchronously (the persist lane's projector): a model would read a
                # few seconds after it was served, so a refused read is tried again after a pause
                await asyncio.sleep(1.0)
                text, err = await self.read_back(cid, uri)
                retried += text is not None
            if text is None:
                unreadable.append(f"{uri}: {err}")
                continue
            readback.append(text)
            for more in find_links([text], self.pattern):
                if more not in seen:
                    seen.add(more)
                    queue.append(more)
                    nested += 1
        c1 = self.stand_in.snapshot()
        llm = {"calls": c1[0] - c0[0], "input_tokens": c1[1] - c0[1], "output_tokens": c1[2] - c0[2]}
        sr = StrategyRun(reqs, compacted, readback=readback, links=len(seen), links_unreadable=len(unreadable),
                         llm_tokens=llm["input_tokens"] + llm["output_tokens"])
        info = {"conversationId": cid, "lastTurnId": last_turn, "failedTurns": failed,
                "compactionDecisions": dict(sorted(decisions.items())), "turnStartDecisions": turn_start,
                "summarizerLlm": llm,
                "linksInLastRequest": len(links), "linksFoundInReadBacks": nested, "linksRead": len(readback),
                "linksNotFollowed": len(queue), "linksReadOnARetry": retried, "unreadableLinks": unreadable[:10]}
        return sr, info

    async def read_back(self, cid: str, uri: str) -> tuple[str | None, str | None]:
        """The full text behind a URI, paged through ctx.blob.fs_read (numbered lines joined back)."""
        lines: list[str] = []
        offset, limit = 1, 2000
        while True:
            r = await self.rpc.call("ctx.blob.fs_read", {"conversationId": cid, "uri": uri, "offset": offset,
                                                         "limit": limit})
            if r.get("kind") == "error":
                if r.get("code") == "output-too-large" and limit > 1:
                    limit = max(1, limit // 2)
                    continue
                return None, f"{r.get('code')}: {str(r.get('message'))[:200]}"
            if r["endLine"] >= r["startLine"]:
                lines += [row.split("\t", 1)[1] if "\t" in row else row for row in r["text"].split("\n")]
            if r["endLine"] >= r["totalLines"]:
                return "\n".join(lines), None
            offset, limit = r["endLine"] + 1, 2000


# ---------------------------------------------------------------- plot

def plot(out_dir: Path, results: dict[str, Any]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for run_name, per_w in results["runs"].items():
        for w, cell in per_w["windows"].items():
            fig, ax = plt.subplots(figsize=(10, 5.5))
            ours = 0
            for name, m in cell["strategies"].items():
                ys = m.get("served_tokens_per_step") or []
                if name.startswith("ctxbuild"):  # solid, dash-dot, dotted: equal curves stay visible
                    style, width = ("-", "-.", ":")[ours % 3], 2.2 - 0.4 * (ours % 3)
                    ours += 1
                else:
                    style, width = "--", 1.0
                ax.plot(range(1, len(ys) + 1), ys, style, label=name, linewidth=width)
            ax.axhline(int(w), color="black", linewidth=1.2, label=f"window {int(w):,}")
            ax.set_xlabel("step")
            ax.set_ylabel("served tokens (cl100k)")
            ax.set_title(f"{run_name} — W = {int(w):,}", fontsize=10)
            ax.legend(fontsize=7, ncol=2)
            ax.grid(alpha=0.3)
            slug = re.sub(r"[^A-Za-z0-9._-]+", "_", run_name).strip("_")
            p = out_dir / f"context-{slug}-{w}.png"
            fig.tight_layout()
            fig.savefig(p, dpi=90)
            plt.close(fig)
            paths.append(str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p))
    return paths


# ---------------------------------------------------------------- main

async def measure_ctxbuild(runs: list[Run], summarizers: list[str], windows: list[int], tokens: TokenCounter,
                           progress, errors: list[dict[str, Any]]
                           ) -> dict[tuple[str, int, str], tuple[StrategyRun, dict]]:
    from ctxbuild_devstack import private_stack
    from ctxbuild_devstack.stack import SERVICES

    stand_in = StandIn(tokens)
    out: dict[tuple[str, int, str], tuple[StrategyRun, dict]] = {}
    total = sum(len(s) for r in runs for _, s in r.turns) * len(summarizers) * len(windows)
    task = progress.add_task("ctxbuild (served steps)", total=total)
    try:
        with private_stack("ctxbuild-bench-context-", services=()) as stack:
            progress.update(task, description="ctxbuild: starting the private stack")
            extra = {"CTX_OPENAI_BASE_URL": stand_in.base_url, "CTX_OPENAI_API_KEY": "bench-stand-in",
                     "CTX_SUMMARIZER_PROVIDER": "openai", "CTX_SUMMARIZER_MODEL": STAND_IN_MODEL}
            await asyncio.to_thread(stack.start_services, SERVICES, extra)
            cb = Ctxbuild(stack.env["CTX_ORCHESTRATION_HTTP"], stack.env["CTX_API_KEY"], stack.env["CTX_NATS_URL"],
                          tokens, stand_in)
            await cb.start()
            try:
                for s in summarizers:
                    for w in windows:
                        for r in runs:
                            progress.update(task, description=f"ctxbuild/{s} W={w} {r.name[:40]}")
                            try:
                                out[(r.name, w, s)] = await cb.replay(r, w, s, progress, task)
                            except Exception as exc:  # noqa: BLE001 — one broken cell is reported, not fatal
                                errors.append({"run": r.name, "window": w, "summarizer": s,
                                               "error": f"{type(exc).__name__}: {str(exc)[:500]}"})
            finally:
                await cb.close()
    finally:
        stand_in.close()
    return out


def git(*argv: str) -> str | None:
    try:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, check=False).stdout
    except OSError:
        return None


def main() -> str | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "context.json")
    ap.add_argument("--data", type=Path, default=TRAJ, help="folder of recorded runs")
    ap.add_argument("--windows", type=int, nargs="+", default=list(WINDOWS))
    ap.add_argument("--summarizers", nargs="+", default=list(SUMMARIZERS), choices=SUMMARIZERS)
    ap.add_argument("--only", nargs="*", help="only runs whose name contains one of these (development)")
    ap.add_argument("--no-ctxbuild", action="store_true", help="peers only (development)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--dump", type=Path, help="write each ctxbuild cell's last request and read-backs here (debug)")
    args = ap.parse_args()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = Console(stderr=True)
    if not console.is_terminal:
        console = Console(stderr=True, width=180)  # a log file: the whole table, not 80 columns
    t0 = time.perf_counter()
    commit = (git("rev-parse", "--short", "HEAD") or "").strip() or None
    dirty = git("status", "--porcelain", "--", "services", "libs")
    head: dict[str, Any] = {"benchmark": "context", "definitions": DEFINITIONS}
    if not args.data.is_dir():
        head["skipped"] = f"recorded runs absent ({args.data})"
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(head, indent=2) + "\n")
        console.print(head["skipped"])
        return
    from ctxbuild_codec.tokens import ENCODING, count_text
    from ctxbuild_compaction.settings import Settings as CompactionSettings
    from ctxbuild_orchestration.app.runner import SYSTEM_PROMPT

    default_summarizer = CompactionSettings.model_fields["summarizer"].default
    tokens = TokenCounter(count_text)
    runs, skipped = discover(args.data)
    if args.only:
        runs = [r for r in runs if any(o in r.name for o in args.only)]
    peers = Peers(tokens)
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    ours = [f"ctxbuild/{s}" for s in args.summarizers] if not args.no_ctxbuild else []
    with Progress(*cols, console=console) as progress:
        errors: list[dict[str, Any]] = []
        served = {} if args.no_ctxbuild else asyncio.run(
            measure_ctxbuild(runs, args.summarizers, args.windows, tokens, progress, errors))
        t_peers = progress.add_task("peers (run × window × peer)", total=len(runs) * len(args.windows) * len(PEERS))
        results: dict[str, Any] = {}
        for r in runs:
            per_w: dict[str, Any] = {}
            for w in args.windows:
                # every strategy gets the system message ctxbuild serves (its first request's)
                sys_text = SYSTEM_PROMPT
                for s in args.summarizers:
                    got = served.get((r.name, w, s))
                    if got and got[0].requests and got[0].requests[0] and got[0].requests[0][0]["role"] == "system":
                        sys_text = got[0].requests[0][0]["content"]
                        break
                system = {"role": "system", "content": sys_text}
                strategies: dict[str, Any] = {}
                infos: dict[str, Any] = {}
                for p in PEERS:
                    progress.update(t_peers, description=f"peers: {p} W={w} {r.name[:40]}")
                    strategies[p] = strategy_metrics(peers.run(p, r, system, w), task=r.task, window=w,
                                                     outputs=r.outputs, tokens=tokens)
                    progress.advance(t_peers)
                for s in args.summarizers:
                    if (r.name, w, s) not in served:
                        continue
                    sr, info = served[(r.name, w, s)]
                    if args.dump:
                        args.dump.mkdir(parents=True, exist_ok=True)
                        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{r.name}-{w}-{s}")
                        (args.dump / f"{slug}.json").write_text(json.dumps(
                            {"last_request": sr.requests[-1] if sr.requests else None, "readback": sr.readback,
                             "outputs": r.outputs, "task": r.task,
                             "requests_without_task": {k + 1: q for k, q in enumerate(sr.requests)
                                                       if not has_task(q, r.task)}}, ensure_ascii=False))
                    m = strategy_metrics(sr, task=r.task, window=w, outputs=r.outputs, tokens=tokens)
                    if len(sr.requests) != len(r.step_at):
                        m["step_count_mismatch"] = {"served": len(sr.requests), "recorded": len(r.step_at)}
                    strategies[f"ctxbuild/{s}"] = m
                    infos[f"ctxbuild/{s}"] = info
                ratio = add_ratios(strategies, [o for o in ours if o in strategies])
                per_w[str(w)] = {"strategies": strategies, "ratios": ratio, "ctxbuild": infos}
            results[r.name] = {"format": r.format, "turns": len(r.turns), "steps": len(r.step_at),
                               "tool_outputs": len(r.outputs), "tool_output_chars": sum(map(len, r.outputs)),
                               "task_chars": len(r.task), "windows": per_w}
    summary: dict[str, Any] = {}
    for o in ours:
        cells = [cell["strategies"][o] for rr in results.values() for cell in rr["windows"].values()
                 if o in cell["strategies"]]
        summary[o.split("/", 1)[1]] = worst_case(cells)
    peer_worst = {p: worst_case([cell["strategies"][p] for rr in results.values() for cell in rr["windows"].values()])
                  for p in PEERS}
    default = summary.get(default_summarizer, {})
    out = {**head, "default_summarizer": default_summarizer,
           "default": {k: default.get(k) for k in GATED} | {
               f"{k}_cells": default.get(f"{k}_cells") for k in ("cost_ratio_vs_best_peer", "cost_ratio_vs_raw")},
           "per_summarizer_worst": summary, "peers_worst": peer_worst,
           "best_summarizer_by_cost": None,
           "runs": results, "skipped": skipped, "errors": errors}
    # which summarizer would be the better default by measurement: all gates held, then the lowest worst ratio
    ok = {s: w for s, w in summary.items()
          if w.get("steps_over_window") == 0 and w.get("no_task_steps") == 0 and w.get("orphan_steps") == 0
          and (w.get("model_recoverable") or 0) >= 0.99}
    if ok:
        out["best_summarizer_by_cost"] = min(ok, key=lambda s: (ok[s].get("cost_ratio_vs_best_peer") or 9e9,
                                                                ok[s].get("cost_ratio_vs_raw") or 9e9))
    d = out["default"]
    out["targets"] = {
        "steps_over_window == 0": d.get("steps_over_window") == 0,
        "no_task_steps == 0": d.get("no_task_steps") == 0,
        "orphan_steps == 0": d.get("orphan_steps") == 0,
        # the targets of issue #17 for the default, on every run and both windows
        "model_recoverable == 1.0": d.get("model_recoverable") == 1.0,
        "prefix_stability_outside_compaction >= 0.99": (d.get("prefix_stability_outside_compaction") or 0) >= 0.99,
        # vacuous (null) when no run exceeds the window or no peer qualifies on any run that does; cheaper than the
        # best peer at all is reported beside the 0.5 (services/compaction/README.md: not reachable under
        # SPEC §2.2's trigger, measured)
        "cost_ratio_vs_best_peer <= 0.5":
            d.get("cost_ratio_vs_best_peer") is None or d["cost_ratio_vs_best_peer"] <= 0.5,
        "cost_ratio_vs_best_peer < 1": d.get("cost_ratio_vs_best_peer") is None or d["cost_ratio_vs_best_peer"] < 1,
        "cost_ratio_vs_raw <= 1": d.get("cost_ratio_vs_raw") is None or d["cost_ratio_vs_raw"] <= 1,
        "every ctxbuild cell measured": not errors,
    } if ours else {}
    out["notes"] = NOTES
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if not args.no_plot:
        out["plots"] = plot(args.out.parent, out)
    import langchain
    import langchain_core

    try:
        from importlib.metadata import version
        da = version("deepagents")
    except Exception:  # noqa: BLE001
        da = None
    out["environment"] = {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
                          "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit,
                          "uncommittedProductChanges": [ln[3:] for ln in (dirty or "").splitlines()],
                          "tokenizer": ENCODING, "windows": args.windows,
                          "versions": {"langchain": langchain.__version__, "langchain-core": langchain_core.__version__,
                                       "deepagents": da}}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    args.out.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")

    table = Table(title=f"bench-context (default summarizer: {default_summarizer})")
    for col in ("run", "W", "strategy", "over W", "no task", "orphan", "recov", "prefix∖comp", "cost", "ratio"):
        table.add_column(col)
    for rn, rr in results.items():
        for w, cell in rr["windows"].items():
            for name, m in cell["strategies"].items():
                ratio = m.get("cost_ratio_vs_best_peer", m.get("cost_ratio_vs_raw", ""))
                table.add_row(rn[:34], w, name, str(m["steps_over_window"]), str(m["no_task_steps"]),
                              str(m["orphan_steps"]), f"{m['model_recoverable']:.3f}",
                              str(m["prefix_stability_outside_compaction"]), f"{m['cache_adjusted_cost']:,.0f}",
                              "" if ratio is None else str(ratio))
    console.print(table)
    console.print_json(json.dumps({"default_summarizer": default_summarizer, "default": out["default"],
                                   "per_summarizer_worst": summary, "targets": out["targets"],
                                   "seconds": out["seconds"]}))
    missed = [k for k, ok in out["targets"].items() if not ok]
    if missed:
        return (f"bench-context: the default summarizer ({default_summarizer}) misses {'; '.join(missed)} — "
                f"see {args.out}")
    return None


if __name__ == "__main__":
    sys.exit(main())
