"""Gateway benchmark (`make bench-gateway` → bench/results/gateway.json): the time a gateway adds to a client's
request, ctxbuild's drop-in gateway beside the LiteLLM proxy, interleaved in one run against the same upstream.

How it runs:
- upstream: the local OpenAI wire-format server (``tests/support/fake_openai.py``) in its own process — a model that
  answers at once and always the same way, so what a gateway adds is what shows;
- direct: the client talks to that upstream itself;
- litellm: the LiteLLM proxy from PyPI (``litellm --config``, its own config in a temporary directory: the one model
  routed to the upstream, a master key checked on every request, no callbacks), in its own process;
- ctxbuild: a private full stack (``ctxbuild_devstack``: NATS JetStream, Postgres with fsync on, SeaweedFS and the six
  services), its gateway ``POST /v1/chat/completions`` with the local API key — every guarantee on (events durable,
  the served request kept, auth checked);
- floor: the durability floor (``bench/durable_floor.py``), no ctxbuild code: a bare Starlette proxy in its own
  process that does only the durable work the guarantees imply — auth against an in-memory dict, one Postgres commit
  (message + queued turn), the upstream call with the served request's S3 PUT beside it, one Postgres commit (the
  answer) — on the private stack's Postgres and SeaweedFS; non-streamed requests only.
The same client (httpx, one keep-alive connection per target, as the SDKs do) sends every request; each round sends
the same request to every target one after another, in a rotating order (the floor in the non-streamed half only).

(a) small: a one-message request (nothing to trim), unique text per round; non-streamed, then streamed.
(b) conversation: a 40-step client-tool conversation — the model (``[[fake: steps=40]]``) calls the client's tool
    40 times, each output ~12k chars (over the in-flight threshold of the bench model's 32k window), the client
    resends the whole history each step as SDK clients do (streamed). Afterwards, untimed, one more client turn per
    trimmed output asks the model (``[[fake: readback=<label>]]``) to read it back through fs_read server-side; the
    answer names chars + sha256 of what the read joined back to, checked against the client's own output.

overhead_ms of a gateway = its time for a request − direct's time for the same request in the same round (paired),
p50/p99 over the rounds (streamed: to the first body byte and to the last).
served_over_raw_tokens: Σ tokens of the requests ctxbuild sent upstream / Σ tokens of the requests the client sent
direct (same counter: the codec's, over each message's text and tool-call arguments), over the conversation's steps.

    .venv/bin/python bench/gateway.py --out bench/results/gateway.json
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from ctxbuild_codec.tokens import count_text
from ctxbuild_devstack import free_port, private_stack
from proc_cpu import CpuGroup  # a sibling module (run from bench/)
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

ROOT = Path(__file__).resolve().parents[1]
MODEL = "bench-model"
WINDOW = 32_000
OUTPUT_CHARS = 12_000
GATEWAYS = ("litellm", "ctxbuild", "floor")
NO_STREAM = {"floor"}  # targets measured non-streamed only
LITELLM_KEY = "sk-bench-litellm"
FLOOR_KEY = "sk-bench-floor"
FULL_OUTPUT = re.compile(r"Full output: (\S+)")  # a trim marker's URI, as the model reads it
TOOL = {"type": "function", "function": {
    "name": "run_step", "description": "Run one step of the job and return its full log.",
    "parameters": {"type": "object", "properties": {"step": {"type": "integer"}, "part": {"type": "integer"}},
                   "required": ["step", "part"]}}}
console = Console(stderr=True)

DEFINITIONS = {
    "overhead_ms": "a gateway's wall time for a request minus direct's for the same request in the same round "
                   "(paired; rounds interleave the targets in a rotating order), p50/p99 over the rounds",
    "stream_first_byte / stream_last_byte": "streamed request: time from sending to the first / last byte of the "
                                            "response body",
    "served_over_raw_tokens": "sum over the conversation's steps of the tokens ctxbuild sent upstream, over the sum "
                              "of the tokens the client sent direct (codec counter over each message's text and "
                              "tool-call arguments)",
    "floor": "the durability floor (bench/durable_floor.py, no ctxbuild code): a bare Starlette/uvicorn proxy in its "
             "own process; per request (1) the bearer key checked against an in-memory dict, (2) one Postgres "
             "transaction (one statement, one commit): the request's last message and a 'queued' turn row, (3) the "
             "request forwarded to the same upstream (one keep-alive httpx client) while, beside that call, the "
             "served request bytes are PUT to S3 (minio in a worker thread), both awaited, (4) one Postgres "
             "transaction: the answer stored and the turn marked answered, (5) the upstream body returned. Same "
             "Postgres (fsync/synchronous_commit as the stack has them, see small.floor_postgres) and SeaweedFS as "
             "the ctxbuild stack, own schema; non-streamed only (the floor skips streaming)",
    "floor_overhead_ratio_vs_litellm_p50": "floor's non-streamed overhead p50 / LiteLLM's, same rounds",
    "overhead_ratio_vs_floor_p50": "ctxbuild's non-streamed overhead p50 / the floor's, same rounds",
    "cpu": "small.cpu: per target, CPU ms (user + system, children included) per small non-streamed request, "
           "measured with that target alone (--census requests each, after the interleaved rounds), per process "
           "group it touches: the shared upstream, and the gateway's own processes (ctxbuild: its six services, "
           "NATS, Postgres, SeaweedFS; floor: its process, Postgres, SeaweedFS; LiteLLM: its process). "
           "added_cpu_ms_per_request = total minus direct's (the upstream's share)",
    "readback_ok": "every client tool output ctxbuild served trimmed (a <persisted-output> marker in the upstream "
                   "request) was read back in full through the gateway: the model's fs_read pages joined back to "
                   "the client's output, same length and sha256",
}


# ---------------------------------------------------------------- processes

def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before {url} answered")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout:g}s")


@contextlib.contextmanager
def process(args: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def litellm_config(tmp: Path, upstream: str) -> Path:
    cfg = tmp / "litellm.yaml"
    cfg.write_text(json.dumps({  # YAML is a superset of JSON
        "model_list": [{"model_name": MODEL, "litellm_params": {
            "model": "openai/bench-litellm", "api_base": upstream, "api_key": "sk-upstream"}}],
        "litellm_settings": {"callbacks": [], "success_callback": [], "failure_callback": [], "telemetry": False},
        "general_settings": {"master_key": LITELLM_KEY},
    }, indent=1))
    return cfg


# ---------------------------------------------------------------- one request

class Target:
    def __init__(self, name: str, base: str, key: str, model_seen_upstream: str) -> None:
        self.name, self.upstream_model = name, model_seen_upstream
        self.http = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=300)
        self.headers: list[dict[str, str]] = []

    def post(self, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        t0 = time.perf_counter()
        r = self.http.post("/chat/completions", json=body)
        r.read()
        dt = (time.perf_counter() - t0) * 1000
        if r.status_code != 200:
            raise RuntimeError(f"{self.name}: {r.status_code} {r.text[:500]}")
        self.headers.append(dict(r.headers))
        return dt, r.json()

    def stream(self, body: dict[str, Any]) -> tuple[float, float, dict[str, Any]]:
        t0 = time.perf_counter()
        first = None
        raw = bytearray()
        with self.http.stream("POST", "/chat/completions", json={**body, "stream": True}) as r:
            for chunk in r.iter_raw():
                if first is None and chunk:
                    first = time.perf_counter()
                raw += chunk
            if r.status_code != 200:
                raise RuntimeError(f"{self.name}: {r.status_code} {bytes(raw)[:500]!r}")
            self.headers.append(dict(r.headers))
        last = time.perf_counter()
        return ((first or last) - t0) * 1000, (last - t0) * 1000, accumulate(bytes(raw).decode())


def accumulate(sse: str) -> dict[str, Any]:
    """The assistant message an OpenAI stream adds up to (content, tool calls by index, finish reason)."""
    content, calls, finish, done = [], {}, None, False
    for line in sse.splitlines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"error in stream: {chunk['error']}")
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            content.append(delta.get("content") or "")
            for tc in delta.get("tool_calls") or []:
                call = calls.setdefault(tc["index"], {"id": "", "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
                call["id"] = tc.get("id") or call["id"]
                fn = tc.get("function") or {}
                call["function"]["name"] += fn.get("name") or ""
                call["function"]["arguments"] += fn.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    if not done or finish is None:
        raise RuntimeError("stream ended without a finish_reason and [DONE]")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {"message": message, "finish_reason": finish}


# ---------------------------------------------------------------- the two workloads

def pct(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p99": None, "n": 0}
    s = sorted(xs)
    return {"p50": round(statistics.median(s), 2), "p99": round(s[min(len(s) - 1, round(0.99 * (len(s) - 1)))], 2),
            "n": len(s)}


def rotation(i: int, names: list[str]) -> list[str]:
    k = i % len(names)
    return names[k:] + names[:k]


def small(targets: dict[str, Target], rounds: int, progress: Progress, task: Any) -> dict[str, Any]:
    names = list(targets)
    lat: dict[str, dict[str, list[float]]] = {
        n: {"nonstream": []} if n in NO_STREAM else {"nonstream": [], "stream_first_byte": [], "stream_last_byte": []}
        for n in names}
    for i in range(rounds):
        for mode in ("nonstream", "stream"):
            for n in rotation(i, [n for n in names if mode == "nonstream" or n not in NO_STREAM]):
                body = {"model": MODEL, "max_tokens": 32,
                        "messages": [{"role": "user", "content": f"Say hello ({mode} round {i}, {n})."}]}
                if mode == "nonstream":
                    dt, _ = targets[n].post(body)
                    lat[n]["nonstream"].append(dt)
                else:
                    first, last, _ = targets[n].stream({**body, "stream_options": {"include_usage": True}})
                    lat[n]["stream_first_byte"].append(first)
                    lat[n]["stream_last_byte"].append(last)
        progress.advance(task)
    return {"rounds": rounds, "latency_ms": {n: {m: pct(v) for m, v in lat[n].items()} for n in names},
            "overhead_ms": overheads(lat)}


def census(targets: dict[str, Target], groups: dict[str, dict[str, list[int]]], n: int, progress: Progress,
             task: Any) -> dict[str, Any]:
    """CPU per request, target by target: ``n`` small non-streamed requests to one target alone while the CPU
    time of every process that request touches is read before and after (``groups``: per target, process group →
    pids, children included). Where a gateway's overhead goes when the machine's cores are the limit: the
    latency of a chain of processes cannot fall below its CPU spread over the cores it can use."""
    out: dict[str, Any] = {}
    for name, target in targets.items():
        procs = {g: CpuGroup(pids) for g, pids in groups[name].items()}
        before = {g: c.seconds() for g, c in procs.items()}
        for i in range(n):
            target.post({"model": MODEL, "max_tokens": 32,
                         "messages": [{"role": "user", "content": f"Say hello (census {i}, {name})."}]})
            progress.advance(task)
        ms = {g: round((c.seconds() - before[g]) / n * 1000, 2) for g, c in procs.items()}
        out[name] = {"cpu_ms_per_request": ms, "total_cpu_ms_per_request": round(sum(ms.values()), 2)}
    up = out.get("direct", {}).get("total_cpu_ms_per_request", 0.0)
    for v in out.values():  # what the gateway's own processes add to the upstream's share
        v["added_cpu_ms_per_request"] = round(v["total_cpu_ms_per_request"] - up, 2)
    return {"requests_per_target": n, "targets": out}


def overheads(lat: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    return {g: {m: pct([a - b for a, b in zip(lat[g][m], lat["direct"][m], strict=True)]) for m in lat[g]}
            for g in GATEWAYS if g in lat}


def tool_output(label: str, step: int) -> str:
    """~OUTPUT_CHARS of a deterministic log; its first line names it (kept in the trimmed head)."""
    lines, n = [f"output-id: {label}"], 0
    while sum(len(x) + 1 for x in lines) < OUTPUT_CHARS:
        digest = hashlib.sha256(f"{label}:{n}".encode()).hexdigest()
        lines.append(f"[step {step:02d}] line {n:04d} status=ok checksum={digest} elapsed={(n * 37) % 1000}ms")
        n += 1
    return "\n".join(lines)


def message_tokens(messages: list[dict[str, Any]]) -> int:
    total = 0
    for m in messages:
        c = m.get("content")
        total += count_text(c if isinstance(c, str) else json.dumps(c) if c else "")
        total += sum(count_text(tc["function"]["arguments"]) for tc in m.get("tool_calls") or [])
    return total


def conversation(targets: dict[str, Target], upstream: httpx.Client, steps: int, progress: Progress,
                 task: Any, rb_task: Any) -> dict[str, Any]:
    names = [n for n in targets if n not in NO_STREAM]
    since = len(upstream.get("/_recorded").json())  # the small requests' bodies are not the conversation's
    # the script in the system prompt: served every step, while compaction may fold the first user message away
    system = {"role": "system", "content": f"You run jobs with run_step. [[fake: steps={steps}]]"}
    first = {"role": "user", "content": "Run the job step by step and tell me when it is done."}
    history = {n: [system, first] for n in names}
    outputs: dict[str, str] = {}
    lat: dict[str, dict[str, list[float]]] = {n: {"stream_first_byte": [], "stream_last_byte": []} for n in names}
    answers: dict[str, str] = {}
    conversation_ids: set[str] = set()
    step = 0
    while len(answers) < len(names):
        for n in rotation(step, names):
            if n in answers:
                continue
            body = {"model": MODEL, "messages": history[n], "tools": [TOOL], "max_tokens": 1024,
                    "stream_options": {"include_usage": True}}
            t_first, t_last, got = targets[n].stream(body)
            lat[n]["stream_first_byte"].append(t_first)
            lat[n]["stream_last_byte"].append(t_last)
            if n == "ctxbuild":
                conversation_ids.add(targets[n].headers[-1].get("x-ctx-conversation-id", "?"))
            msg = got["message"]
            history[n].append(msg)
            if not msg.get("tool_calls"):
                answers[n] = msg["content"] or ""
                continue
            for call in msg["tool_calls"]:
                args = json.loads(call["function"]["arguments"])
                label = f"s{args['step']:02d}p{args['part']}"
                outputs[label] = tool_output(label, args["step"])
                history[n].append({"role": "tool", "tool_call_id": call["id"], "content": outputs[label]})
        step += 1
        progress.advance(task)
        if step > steps + 2:
            raise RuntimeError(f"the conversation did not end after {steps} steps: {answers}")
    if len({len(v["stream_last_byte"]) for v in lat.values()}) != 1:  # paired overheads need the same steps
        ended = {n: len(v["stream_last_byte"]) for n, v in lat.items()}
        raise RuntimeError(f"the targets ended after different steps: {ended} {answers}")
    # what each target sent upstream, per step (the fake records every body)
    recorded = upstream.get("/_recorded", params={"since": since}).json()
    sent = {n: [message_tokens(b["messages"]) for b in recorded if b["model"] == targets[n].upstream_model]
            for n in names}
    served = [b for b in recorded if b["model"] == targets["ctxbuild"].upstream_model] if "ctxbuild" in names else []
    out: dict[str, Any] = {"steps": step, "answers": answers,
                           "latency_ms": {n: {m: pct(v) for m, v in lat[n].items()} for n in names},
                           "overhead_ms": overheads(lat),
                           "upstream_tokens_per_target": {n: sum(v) for n, v in sent.items()}}
    if "ctxbuild" in names:
        out["raw_tokens"] = sum(sent["direct"])
        out["served_tokens"] = sum(sent["ctxbuild"])
        out["served_over_raw_tokens"] = round(out["served_tokens"] / max(1, out["raw_tokens"]), 4)
        out["ctxbuild_conversations"] = len(conversation_ids)
        out["ctxbuild_headers_last"] = {k: v for k, v in targets["ctxbuild"].headers[-1].items()
                                        if k.startswith("x-ctx-")}
        out.update(readback(targets["ctxbuild"], upstream, history["ctxbuild"], outputs, served, progress, rb_task))
    return out


def tool_names(body: dict[str, Any], result: dict[str, Any]) -> set[str]:
    """The name of the call a tool message answers (OpenAI tool messages carry only the call id)."""
    return {c["function"]["name"] for m in body["messages"] if m["role"] == "assistant"
            for c in m.get("tool_calls") or [] if c["id"] == result.get("tool_call_id")}


def readback(target: Target, upstream: httpx.Client, history: list[dict[str, Any]], outputs: dict[str, str],
             served: list[dict[str, Any]], progress: Progress, task: Any) -> dict[str, Any]:
    """One client turn per output ctxbuild served trimmed: the model reads it back through fs_read (server-side),
    by the URI its marker showed the model (a long history folds old outputs out of view); its answer names the
    chars and sha256 of what the pages joined back to."""
    uris: dict[str, str] = {}
    for body in served:
        for m in body["messages"]:
            text = m.get("content") if m["role"] == "tool" else None
            if isinstance(text, str) and text.startswith("output-id: ") and "<persisted-output>" in text:
                label = text.split("\n", 1)[0].removeprefix("output-id: ")
                if label in outputs and (found := FULL_OUTPUT.search(text)):
                    uris.setdefault(label, found.group(1))
    progress.update(task, total=len(uris))
    checked, failures = 0, []
    for label, uri in sorted(uris.items()):
        since = len(upstream.get("/_recorded", params={"since": 0}).json())
        history.append({"role": "user", "content": f"Read {label} back in full. [[fake: readback={uri}]]"})
        _, got = target.post({"model": MODEL, "messages": history, "tools": [TOOL], "max_tokens": 1024})
        msg = got["choices"][0]["message"]
        history.append({"role": "assistant", "content": msg.get("content")})
        text = outputs[label]
        want = f"chars={len(text)} sha256={hashlib.sha256(text.encode()).hexdigest()}"
        lines = [x for x in (msg.get("content") or "").splitlines() if x.startswith(f"readback {uri} {uri} ")]
        if lines and all(x.endswith(want) for x in lines):
            checked += 1
        else:
            bodies = upstream.get("/_recorded", params={"since": since}).json()
            reads = [m["content"] for b in bodies for m in b["messages"]
                     if m["role"] == "tool" and "fs_read" in tool_names(b, m)]
            failures.append({"label": label, "uri": uri, "want": want,
                             "got": lines or (msg.get("content") or "")[:300],
                             "fs_read_said": [r[:300] for r in reads[-2:]],
                             "uri_in_served_request": bool(bodies) and uri in json.dumps(bodies[0]),
                             "served_request_roles": [m["role"] for m in bodies[0]["messages"]] if bodies else []})
        progress.advance(task)
    return {"outputs": len(outputs), "trimmed_outputs": len(uris), "read_back_in_full": checked,
            "readback_failures": failures[:5],
            "readback_ok": bool(uris) and checked == len(uris) == len(outputs)}


# ---------------------------------------------------------------- run

def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ctxbuild-bench-gateway-") as tmp_s, contextlib.ExitStack() as stack:
        tmp = Path(tmp_s)
        up_port = free_port()
        upstream_url = f"http://127.0.0.1:{up_port}/v1"
        fake = stack.enter_context(process([sys.executable, "-m", "tests.support.fake_openai", "--port",
                                            str(up_port)], tmp / "upstream.log", {"PYTHONPATH": str(ROOT)}))
        wait_http(f"http://127.0.0.1:{up_port}/_recorded?since=1000000", 30, fake)
        targets = {"direct": Target("direct", upstream_url, "sk-upstream", "bench-model")}
        if "litellm" in args.targets:
            ll_port = free_port()
            env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False", "LITELLM_LOG": "ERROR"}
            ll = stack.enter_context(process(
                [str(Path(sys.executable).with_name("litellm")), "--config", str(litellm_config(tmp, upstream_url)),
                 "--host", "127.0.0.1", "--port", str(ll_port), "--num_workers", "1"], tmp / "litellm.log", env))
            console.print("starting the LiteLLM proxy …")
            wait_http(f"http://127.0.0.1:{ll_port}/health/liveliness", 180, ll)
            targets["litellm"] = Target("litellm", f"http://127.0.0.1:{ll_port}/v1", LITELLM_KEY, "bench-litellm")
        if "ctxbuild" in args.targets or "floor" in args.targets:
            os.environ["CTX_OPENAI_BASE_URL"] = upstream_url
            os.environ["CTX_OPENAI_API_KEY"] = "sk-upstream"
            os.environ["CTX_GATEWAY_MODELS"] = json.dumps({MODEL: {
                "dialect": "openai", "contextWindow": WINDOW, "upstreamModel": "bench-ctxbuild"}})
            console.print("starting a private ctxbuild stack …")
            st = stack.enter_context(private_stack("ctxbuild-bench-gateway-", **(
                {} if "ctxbuild" in args.targets else {"services": ()})))  # the floor alone needs only Postgres + S3
            if "ctxbuild" in args.targets:
                targets["ctxbuild"] = Target("ctxbuild", st.env["CTX_ORCHESTRATION_HTTP"] + "/v1",
                                             st.env["CTX_API_KEY"], "bench-ctxbuild")
        floor_postgres = None
        if "floor" in args.targets:
            fl_port = free_port()
            fl_env = {k: v for k, v in st.env.items() if k.startswith(("CTX_DATABASE_URL", "CTX_S3_"))}
            fl = stack.enter_context(process(
                [sys.executable, str(ROOT / "bench" / "durable_floor.py"), "--port", str(fl_port), "--upstream",
                 upstream_url, "--key", FLOOR_KEY], tmp / "floor.log", fl_env))
            wait_http(f"http://127.0.0.1:{fl_port}/health", 60, fl)
            floor_postgres = httpx.get(f"http://127.0.0.1:{fl_port}/health").json()["postgres"]
            targets["floor"] = Target("floor", f"http://127.0.0.1:{fl_port}/v1", FLOOR_KEY, MODEL)
        upstream = httpx.Client(base_url=f"http://127.0.0.1:{up_port}", timeout=120)
        cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*cols, console=console) as progress:
            t_warm = progress.add_task("warm-up", total=args.warmup)
            for i in range(args.warmup):  # first requests pay imports, connection set-up, first-time caches
                for t in targets.values():
                    t.post({"model": MODEL, "messages": [{"role": "user", "content": f"warm-up {i}"}]})
                    if t.name not in NO_STREAM:
                        t.stream({"model": MODEL, "messages": [{"role": "user", "content": f"warm-up {i} stream"}]})
                progress.advance(t_warm)
            for t in targets.values():
                t.headers.clear()
            t_small = progress.add_task("(a) small request, rounds", total=args.rounds)
            result_small = small(targets, args.rounds, progress, t_small)
            result_small["ctxbuild_reported_overhead_ms"] = pct(
                [float(h["x-ctx-overhead-ms"]) for h in targets["ctxbuild"].headers if "x-ctx-overhead-ms" in h]
            ) if "ctxbuild" in targets else None
            groups: dict[str, dict[str, list[int]]] = {"direct": {"upstream": [fake.pid]}}
            if "litellm" in targets:
                groups["litellm"] = {"upstream": [fake.pid], "litellm": [ll.pid]}
            if "ctxbuild" in targets:
                groups["ctxbuild"] = {"upstream": [fake.pid], **{
                    name: [info["pid"]] for name, info in st.procs.items()}}
            if "floor" in targets:
                groups["floor"] = {"upstream": [fake.pid], "floor": [fl.pid], **{
                    name: [st.procs[name]["pid"]] for name in ("postgres", "s3")}}
            t_cpu = progress.add_task("CPU per request, one target at a time", total=args.census * len(targets))
            result_small["cpu"] = census(targets, groups, args.census, progress, t_cpu)
            t_conv = progress.add_task(f"(b) {args.steps}-step conversation, steps", total=args.steps + 1)
            t_rb = progress.add_task("(b) read-back through the gateway", total=None)
            result_conv = conversation(targets, upstream, args.steps, progress, t_conv, t_rb)
        o = result_small["overhead_ms"]
        if "litellm" in o and "ctxbuild" in o:
            ll_p50, cb_p50 = o["litellm"]["nonstream"]["p50"], o["ctxbuild"]["nonstream"]["p50"]
            result_small["overhead_ratio_vs_litellm_p50"] = round(cb_p50 / ll_p50, 3) if ll_p50 > 0 else None
            result_small["overhead_ratio_vs_litellm_p50_stream_last_byte"] = round(
                o["ctxbuild"]["stream_last_byte"]["p50"] / max(1e-9, o["litellm"]["stream_last_byte"]["p50"]), 3)
        if "floor" in o:
            fl_p50 = o["floor"]["nonstream"]["p50"]
            result_small["floor_postgres"] = floor_postgres
            # the floor did the durable work it is credited with: one answered turn and one object per request
            sent = args.warmup + args.rounds + args.census
            written = httpx.get(f"http://127.0.0.1:{fl_port}/written", timeout=30).json()
            result_small["floor_written"] = {**written, "requests": sent}
            if written != {"turns_answered": sent, "s3_objects": sent}:
                raise RuntimeError(f"the floor did not write one turn and one object per request: {written}, {sent}")
            if "litellm" in o:
                ll_p50 = o["litellm"]["nonstream"]["p50"]
                result_small["floor_overhead_ratio_vs_litellm_p50"] = round(fl_p50 / ll_p50, 3) if ll_p50 > 0 else None
            if "ctxbuild" in o:
                result_small["overhead_ratio_vs_floor_p50"] = (
                    round(o["ctxbuild"]["nonstream"]["p50"] / fl_p50, 3) if fl_p50 > 0 else None)
        return {"small": result_small, "conversation": result_conv}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gateway.json")
    ap.add_argument("--rounds", type=int, default=60,
                    help="rounds of the small request (each: every target non-streamed, then streamed but the floor)")
    ap.add_argument("--steps", type=int, default=40, help="client-tool steps of the conversation")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--census", type=int, default=200,
                    help="small requests per target for the CPU census (CPU times tick at 10 ms)")
    ap.add_argument("--targets", nargs="+", default=list(GATEWAYS), choices=list(GATEWAYS),
                    help="gateways to measure beside direct (development)")
    args = ap.parse_args()
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    result = run(args)
    small_r, conv = result["small"], result["conversation"]
    head = {
        "benchmark": "gateway",
        "targets": {"/small/overhead_ratio_vs_litellm_p50": "<= 1.0",
                    "/conversation/served_over_raw_tokens": "<= 0.5", "/conversation/readback_ok": True},
        "headline": {
            "small_overhead_ratio_vs_litellm_p50": small_r.get("overhead_ratio_vs_litellm_p50"),
            "small_floor_overhead_ratio_vs_litellm_p50": small_r.get("floor_overhead_ratio_vs_litellm_p50"),
            "small_overhead_ratio_vs_floor_p50": small_r.get("overhead_ratio_vs_floor_p50"),
            "small_overhead_ms_p50": {g: v["nonstream"]["p50"] for g, v in small_r["overhead_ms"].items()},
            "conversation_overhead_ms_p50_last_byte": {g: v["stream_last_byte"]["p50"]
                                                       for g, v in conv["overhead_ms"].items()},
            "served_over_raw_tokens": conv.get("served_over_raw_tokens"), "readback_ok": conv.get("readback_ok"),
            "small_added_cpu_ms_per_request": {g: v["added_cpu_ms_per_request"]
                                               for g, v in small_r["cpu"]["targets"].items() if g != "direct"}},
        "definitions": DEFINITIONS,
    }
    out = {**head, **result, "seconds": round(time.perf_counter() - t0, 1), "environment": {
        "python": platform.python_version(), "cpus": os.cpu_count(), "load_before": load_before,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "window": WINDOW,
        "output_chars": OUTPUT_CHARS, "litellm": _version("litellm")}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2, ensure_ascii=False) + "\n")
    console.print_json(json.dumps(head["headline"]))
    missed = []
    if small_r.get("overhead_ratio_vs_litellm_p50") is not None and small_r["overhead_ratio_vs_litellm_p50"] > 1.0:
        missed.append("small overhead p50 <= LiteLLM's")
    if "served_over_raw_tokens" in conv and conv["served_over_raw_tokens"] > 0.5:
        missed.append("served/raw tokens <= 0.5")
    if "readback_ok" in conv and not conv["readback_ok"]:
        missed.append("every trimmed output read back in full")
    if missed:
        sys.exit(f"gateway targets missed ({'; '.join(missed)}): see {args.out}")


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
