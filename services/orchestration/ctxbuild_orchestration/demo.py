"""`make run`'s main job: an offline agent turn through all six services, reported step by step.

A conversation gets a generated 20-page service log as an attachment; under a 16k-token window a replayed
agent reads it with read_file page by page (each page is trimmed in flight and its full text offloaded to the
blob store), reads the archived page with the anomaly back with fs_read, asks an MCP tool for the time, and
answers. When a turn's requests grow past the compaction trigger, in-loop compaction folds the older steps
between two steps (memoised: later steps reuse the fold), so no request exceeds the trigger. A third turn starts
over the trigger and is folded at turn start. Everything goes through the real HTTP edge, NATS, Postgres and S3.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from ctxbuild_codec import compaction_budget
from httpx_sse import connect_sse
from rich.console import Console
from rich.table import Table

from .domain.steps import compaction_label, step_rows

PAGE = 8000
PAGES = 20
WINDOW = 16_000
app = typer.Typer(add_completion=False)
console = Console(width=None if Console().is_terminal else 120)


def generate_log(pages: int = PAGES, seed: int = 7) -> str:
    """A deterministic service log of exactly `pages` read_file pages, with one anomaly on page 14."""
    rng = random.Random(seed)
    lines: list[str] = []
    size = 0
    i = 0
    routes = ["/v1/items", "/v1/orders", "/v1/users", "/v1/search"]
    while size < pages * PAGE:
        ts = f"2026-11-29T10:{(i // 60) % 60:02d}:{i % 60:02d}.{rng.randrange(1000):03d}Z"
        if i == 1650:
            line = f"{ts} ERROR sensor-3 temperature_c=21.1 exceeded threshold 20.0 (rack B7)"
        else:
            line = (f"{ts} INFO api-{rng.randrange(8)} GET {rng.choice(routes)}/{rng.randrange(10_000)} "
                    f"200 latency_ms={rng.uniform(2, 119):.1f}")
        lines.append(line)
        size += len(line) + 1
        i += 1
    return "\n".join(lines)[: pages * PAGE]


def read_pages(first: int, last: int) -> list[dict[str, Any]]:
    return [{"toolCalls": [{"toolName": "read_file",
                            "input": {"filename": "service.log", "offset": (p - 1) * PAGE, "limit": PAGE}}]}
            for p in range(first, last + 1)]


def anomaly_position(log_text: str) -> tuple[int, int]:
    """(page, line within that page's read_file output) of the ERROR line."""
    pos = log_text.index(" ERROR ")
    page = pos // PAGE + 1
    return page, log_text[(page - 1) * PAGE: pos].count("\n") + 1


def turns(log_text: str) -> list[tuple[str, list[dict[str, Any]]]]:
    page, line = anomaly_position(log_text)
    return [
    ("Read the first half of service.log and tell me what kind of traffic it shows.",
     [*read_pages(1, 10),
      {"text": "Pages 1–10 are steady GET traffic across four routes with latencies between 2 and 119 ms."}]),
    ("Now read the second half. Is there anything unusual? Check the exact line and tell me the time.",
     [*read_pages(11, page),
      # the excerpt of page {page} hides its middle: read the archived full page back around the anomaly right
      # away (the newest archived output; in-loop compaction may fold the page out of the request later — its
      # URI then stays listed in the summary row)
      {"toolCalls": [{"toolName": "fs_read", "input": {"uri": "{{last_offload_uri}}",
                                                       "offset": max(1, line - 2), "limit": 5}}]},
      *read_pages(page + 1, 20),
      {"toolCalls": [{"toolName": "mcp:time/get_current_time", "input": {"timezone": "UTC"}}]},
      {"text": f"One anomaly on page {page}: an ERROR from sensor-3, temperature_c=21.1 over the 20.0 threshold."}]),
    ("Summarise everything we found so far in one sentence.",
     [{"text": "Steady API traffic, plus one sensor alert (temperature 21.1 °C over a 20.0 threshold)."}]),
    ]


def compaction_by_step(events: list[dict[str, Any]]) -> dict[int, list[tuple[str, str]]]:
    """(phase, label) of the compaction decisions recorded before each step of a turn: the turn-start decision
    before step 1, an in-loop fold before the step it applies to."""
    out: dict[int, list[tuple[str, str]]] = {}
    pending: list[tuple[str, str]] = []
    for e in events:
        d = e["data"]
        if e["type"] == "CompactionDecided":
            label = compaction_label(d)
            if d.get("fallback"):
                label += f" ({d['fallback']} fallback)"
            pending.append((d.get("phase", "turn-start"), label))
        elif e["type"] == "StepServed":
            out[d["step"]] = pending
            pending = []
    return out


def inspector_url(base_url: str, conversation_id: str) -> str:
    """The context inspector's page of a conversation (the edge's /ui)."""
    return f"{base_url.rstrip('/')}/ui/conversations/{conversation_id}"


def _env_url(stack_dir: Path) -> str:
    env = dict(line.split("=", 1) for line in (stack_dir / "stack.env").read_text().splitlines() if "=" in line)
    return env["CTX_ORCHESTRATION_HTTP"]


def _stack_key(stack_dir: Path) -> str:
    """The local stack's API key (written by `make up` to <dir>/api-key)."""
    path = stack_dir / "api-key"
    if not path.is_file():
        raise SystemExit(f"no API key in {path}: start the stack with `make up`, or pass --api-key / CTXBUILD_API_KEY")
    return path.read_text().strip()


def run_demo(base_url: str, out: Console = console, model: str | None = None, *, api_key: str) -> dict[str, Any]:
    """Replay by default; with `model`, the same user turns go to the server's OpenAI-compatible endpoint."""
    rows: list[dict[str, Any]] = []
    with httpx.Client(base_url=base_url, timeout=120, headers={"Authorization": f"Bearer {api_key}"}) as http:
        conv = http.post("/v1/conversations", json={
            "title": "offline demo", "settings": {"contextWindow": WINDOW, "mcpServers": ["time"]}})
        conv.raise_for_status()
        cid = conv.json()["id"]
        log_text = generate_log()
        att = http.post(f"/v1/conversations/{cid}/attachments",
                        files={"file": ("service.log", log_text.encode(), "text/plain")})
        att.raise_for_status()
        out.print(f"conversation [bold]{cid}[/bold]: attached service.log "
                  f"({len(log_text):,} chars, {PAGES} pages of {PAGE:,}) under a {WINDOW:,}-token window")
        for n, (text, script) in enumerate(turns(log_text), 1):
            t0 = time.monotonic()
            provider = {"kind": "openai", "model": model} if model else {"kind": "replay", "script": script}
            r = http.post(f"/v1/conversations/{cid}/turns", json={"text": text, "provider": provider})
            r.raise_for_status()
            turn = r.json()
            terminal = None
            with out.status(f"turn {n}: running…") as status, \
                    connect_sse(http, "GET", turn["events"]) as sse:
                for ev in sse.iter_sse():
                    if not ev.data:  # keep-alive
                        continue
                    data = json.loads(ev.data)
                    if ev.event == "StepServed":
                        status.update(f"turn {n}: step {data['step']} served {data['servedTokens']:,} tokens")
                    if ev.event in ("TurnCompleted", "TurnFailed"):
                        terminal = (ev.event, data)
                        break
            if terminal is None or terminal[0] != "TurnCompleted":
                raise RuntimeError(f"turn {n} did not complete: {terminal}")
            events = http.get(f"/v1/conversations/{cid}/turns/{turn['turnId']}").json()["events"]
            decided = compaction_by_step(events)
            for row in step_rows(events):
                labels = decided.get(row["step"], [])
                rows.append({"turn": n, **row,
                             "turnStart": next((lb for ph, lb in labels if ph == "turn-start"), None),
                             "inLoop": [lb for ph, lb in labels if ph == "in-loop"],
                             "compaction": "; ".join(f"{ph}: {lb}" for ph, lb in labels) or "-"})
            out.print(f"turn {n} completed in {time.monotonic() - t0:.1f}s ({terminal[1]['steps']} steps)")
    trigger = compaction_budget(WINDOW).trigger
    table = Table(title=f"ctxbuild offline demo — one row per model call (window {WINDOW:,}, "
                        f"compaction trigger {trigger:,} tokens)")
    for col in ("turn", "step", "tools called", "input tokens", "trimmed", "offloaded", "compaction",
                "request"):
        table.add_column(col, justify="left" if col in ("tools called", "compaction", "request") else "right")
    for r in rows:
        tools = ", ".join("mcp:" + t.split("__")[2].rsplit("_", 1)[0] if t.startswith("mcp__") else t
                          for t in r["tools"]) or "—"
        tokens = r["inputTokens"] if r["inputTokens"] is not None else r["servedTokens"]
        # in-loop compaction folds between steps, so no request should be over the trigger: flag any that is
        flag = " [red]>trigger[/red]" if tokens > trigger else ""
        table.add_row(str(r["turn"]), str(r["step"]), tools, f"{tokens:,}{flag}", str(r["trimmed"]),
                      str(r["offloaded"]), r["compaction"], r["requestHash"])
    out.print(table)
    summary = {
        "conversationId": cid,
        "steps": len(rows),
        "maxServedTokens": max(r["servedTokens"] for r in rows),
        "maxInputTokens": max(r["inputTokens"] or 0 for r in rows),
        "outputsTrimmed": sum(r["trimmed"] for r in rows),
        "blobsWritten": sum(r["offloaded"] for r in rows),
        "attachmentChars": len(log_text),
        "turnStartCompaction": [r["turnStart"] or "-" for r in rows if r["step"] == 1],
        "inLoopFolds": [(r["turn"], r["step"], lb) for r in rows for lb in r["inLoop"]],
        "trigger": trigger,
        "requestsOverTrigger": sum(1 for r in rows
                                   if (r["inputTokens"] if r["inputTokens"] is not None else r["servedTokens"])
                                   > trigger),
    }
    out.print(f"largest request: {summary['maxInputTokens']:,} tokens for a {WINDOW:,}-token window "
              f"(trigger {trigger:,}; {len(summary['inLoopFolds'])} in-loop fold(s), "
              f"{summary['requestsOverTrigger']} request(s) over the trigger); "
              f"{summary['outputsTrimmed']} outputs trimmed, {summary['blobsWritten']} full texts offloaded "
              "and readable with fs_read.")
    if not model:
        out.print("Model decisions were replayed (no API key needed). To run the same turns on a real model, "
                  "start the stack with an OpenAI-compatible endpoint and name a model:\n"
                  "  make down && CTX_OPENAI_BASE_URL=https://api.openai.com/v1 CTX_OPENAI_API_KEY=sk-… make up\n"
                  "  make demo MODEL=gpt-4o-mini\n"
                  "(any OpenAI-compatible server works: vLLM, Ollama at http://127.0.0.1:11434/v1, Gemini's endpoint)")
    return summary


@app.command()
def main(url: Annotated[str | None, typer.Option(help="orchestration base URL")] = None,
         stack_dir: Annotated[Path, typer.Option("--dir")] = Path(".stack"),
         json_out: Annotated[Path | None, typer.Option("--json")] = None,
         model: Annotated[str | None, typer.Option(help="a model on the server's OpenAI-compatible endpoint "
                                                        "instead of the replayed decisions")] = None,
         api_key: Annotated[str | None, typer.Option(envvar="CTXBUILD_API_KEY",
                                                     help="default: the local stack's <dir>/api-key")] = None) -> None:
    """Run the offline demo against a running stack (make up)."""
    base = url or _env_url(stack_dir)
    summary = run_demo(base, model=model, api_key=api_key or _stack_key(stack_dir))
    key_from = "your API key" if api_key else f"the API key in {stack_dir / 'api-key'}"
    console.print(f"Context inspector (what the model saw, step by step): "
                  f"[bold]{inspector_url(base, summary['conversationId'])}[/bold] — log in with {key_from}")
    console.print(f"Drop-in gateway (README, \"Drop-in gateway\"): OpenAI SDKs at [bold]{base.rstrip('/')}/v1[/bold], "
                  f"Anthropic SDKs at [bold]{base.rstrip('/')}[/bold], with {key_from} as the API key")
    if json_out:
        json_out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    app()
