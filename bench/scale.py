"""No-ceiling benchmark (`make bench-scale` → bench/results/scale.json): conversations far past any single message's
size stay usable, turn start costs what the window costs, and events stay small (SPEC §15.1).

How it runs: a private stack in a temporary directory (NATS JetStream with its default 1 MB max_payload, Postgres
with fsync on, SeaweedFS S3 and the six services as processes). Nothing is mocked; the model is a replay.

1. Volume: one conversation of ``--turns`` turns (default 50) through the HTTP API, each turn one tool call whose
   recorded output is a distinct ~2.1 MB log, then an answer. Afterwards every read a front end makes must answer:
   the history, every step's served request (sha256 = StepServed.requestHash), every trimmed output read back in
   full (sha256 = the original's), and one more turn. ``largest_history_bytes`` is the conversation's content
   with every tool output in full: the bytes of the history's messages (compact JSON) with each trimmed output
   replaced by its read-back.
2. Turn start: conversations with 1,000 and 10,000 history messages, written through the persist lane (the real
   persistence path a finished turn takes: UserMessageAdded, then ctx.persist.complete_turn with the turn's
   assistant/tool messages — 100 messages per seeded turn, tool outputs of 600 characters). Then one real turn
   through the HTTP API (its turn-start compaction folds the old history into a stored summary, as the first turn
   after a long history does). ``turn_start_ms`` is then the median round trip of ``ctx.compact.turn_start`` for
   the conversation's latest message over ``--repeats`` calls (the call every turn makes first: history read,
   decision, the stored summary reused), the two sizes' calls interleaved so both see the same machine load.
   ``turn_start_growth`` = ms at 10,000 / ms at 1,000 (target ≤ 2.0).
   The first, folding turn start is reported too (``first_turn_start_ms``): it reads what it folds.
3. ``max_event_bytes``: the largest stored event (octet length of data + metadata JSON) in persistence.events
   after everything above (target ≤ 65,536). ``bricked_conversations``: conversations where any read or new turn
   failed (target 0).

    .venv/bin/python bench/scale.py --out bench/results/scale.json
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from ctxbuild_devstack import Stack, private_stack
from ctxbuild_platform.rpc import RpcClient
from faststream.nats import NatsBroker
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 32_000
OUTPUT_CHARS = 2_100_000
SEED_MESSAGES_PER_TURN = 100
SHELL = [{"name": "shell", "description": "run a shell command",
          "inputSchema": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]
TARGETS = {"bricked_conversations": ("==", 0), "largest_history_bytes": (">=", 100_000_000),
           "turn_start_growth": ("<=", 2.0), "max_event_bytes": ("<=", 65_536)}


def big_output(turn: int) -> str:
    line = f"turn {turn:03d} build log: compiling module and linking objects, all steps green\n"
    return line * (OUTPUT_CHARS // len(line)) + f"END OF TURN {turn}\n"


class Api:
    def __init__(self, base: str, api_key: str) -> None:
        self.http = httpx.AsyncClient(base_url=base, timeout=300, headers={"Authorization": f"Bearer {api_key}"})

    async def aclose(self) -> None:
        await self.http.aclose()

    async def conversation(self, title: str) -> str:
        r = await self.http.post("/v1/conversations", json={"title": title, "settings": {"contextWindow": WINDOW}})
        r.raise_for_status()
        return r.json()["id"]

    async def turn(self, cid: str, text: str, script: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                   timeout: float = 300) -> tuple[str, list[dict[str, Any]]]:
        provider = {"kind": "replay", "script": script, **({"tools": tools} if tools else {})}
        r = await self.http.post(f"/v1/conversations/{cid}/turns", json={"text": text, "provider": provider})
        if r.status_code != 202:
            raise RuntimeError(f"turn refused ({r.status_code}): {r.text[:300]}")
        tid = r.json()["turnId"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            log = await self.http.get(f"/v1/conversations/{cid}/turns/{tid}")
            log.raise_for_status()
            events = log.json()["events"]
            ends = [e for e in events if e["type"] in ("TurnCompleted", "TurnFailed")]
            if ends:
                if ends[0]["type"] != "TurnCompleted":
                    raise RuntimeError(f"turn {tid} failed: {ends[0]['data']}")
                return tid, events
            await asyncio.sleep(0.2)
        raise RuntimeError(f"turn {tid} did not end in {timeout} s")

    async def messages(self, cid: str) -> list[dict[str, Any]]:
        r = await self.http.get(f"/v1/conversations/{cid}/messages")
        r.raise_for_status()
        return r.json()["messages"]


# ---------------------------------------------------------------- 1. volume

async def volume(api: Api, turns: int, progress: Progress) -> dict[str, Any]:
    task = progress.add_task("volume: turns of 2.1 MB outputs", total=turns)
    cid = await api.conversation("volume")
    digests: dict[str, str] = {}  # toolCallId → sha256 of the original output
    runs: list[tuple[str, list[dict[str, Any]]]] = []
    failures: list[str] = []
    t0 = time.perf_counter()
    for k in range(1, turns + 1):
        out = big_output(k)
        script = [{"toolCalls": [{"toolName": "shell", "input": {"cmd": f"make build-{k}"},
                                  "output": {"type": "text", "value": out}}]}, {"text": f"build {k} is green"}]
        try:
            tid, events = await api.turn(cid, f"run build {k}", script, SHELL)
        except Exception as exc:  # noqa: BLE001 — counted, the bench goes on
            failures.append(f"turn {k}: {exc}")
            progress.advance(task)
            continue
        runs.append((tid, events))
        for e in events:
            if e["type"] == "ToolResultRecorded":
                digests[e["data"]["toolCallId"]] = hashlib.sha256(out.encode()).hexdigest()
        progress.advance(task)
    turns_s = time.perf_counter() - t0

    reads = progress.add_task("volume: read back everything", total=len(runs))
    history_bytes = 0
    requests_ok = readbacks_ok = 0
    try:
        msgs = await api.messages(cid)
    except Exception as exc:  # noqa: BLE001
        failures.append(f"history: {exc}")
        msgs = []
    for m in msgs:
        for p in m["parts"]:
            call = p.get("toolCallId")
            if p.get("type") == "tool-result" and call in digests:
                r = await api.http.get(f"/v1/conversations/{cid}/messages/{m['id']}/results/{call}")
                if r.status_code != 200:
                    failures.append(f"read-back {call}: {r.status_code}")
                    continue
                full = r.json()["output"]
                if hashlib.sha256(full["value"].encode()).hexdigest() == digests[call]:
                    readbacks_ok += 1
                else:
                    failures.append(f"read-back {call}: content differs")
                history_bytes += len(json.dumps({**p, "output": full}, ensure_ascii=False).encode())
            else:
                history_bytes += len(json.dumps(p, ensure_ascii=False).encode())
    for tid, events in runs:
        for s in (e["data"] for e in events if e["type"] == "StepServed"):
            r = await api.http.get(f"/v1/conversations/{cid}/turns/{tid}/steps/{s['step']}/request")
            if r.status_code == 200 and hashlib.sha256(r.content).hexdigest() == s["requestHash"]:
                requests_ok += 1
            else:
                failures.append(f"request {tid}/{s['step']}: {r.status_code}")
        progress.advance(reads)
    try:
        await api.turn(cid, "summarise the builds", [{"text": "all green"}])
        new_turn_ok = True
    except Exception as exc:  # noqa: BLE001
        failures.append(f"new turn: {exc}")
        new_turn_ok = False
    steps = sum(1 for _, ev in runs for e in ev if e["type"] == "StepServed")
    return {"conversationId": cid, "turns": turns, "turnsCompleted": len(runs), "toolOutputBytes":
            turns * len(big_output(1).encode()), "historyBytes": history_bytes, "historyMessages": len(msgs),
            "stepRequestsReadable": f"{requests_ok}/{steps}", "readBacksIdentical": f"{readbacks_ok}/{len(digests)}",
            "newTurnAfterwards": new_turn_ok, "turnsSeconds": round(turns_s, 1), "failures": failures[:20],
            "bricked": bool(failures)}


# ---------------------------------------------------------------- 2. turn start

def seeded_turn(turn: int, parent: str | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A user message and the 99 assistant/tool messages a finished turn adds (49 tool calls, then an answer)."""
    uid = f"msg_seed_{turn:05d}_u"
    user = {"id": uid, "parentId": parent, "role": "user",
            "parts": [{"type": "text", "text": f"seeded request {turn}: look through the logs"}]}
    out: list[dict[str, Any]] = []
    prev = uid
    for i in range((SEED_MESSAGES_PER_TURN - 2) // 2):
        call = f"call_seed_{turn}_{i}"
        a = {"id": f"msg_seed_{turn:05d}_{i:02d}a", "parentId": prev, "role": "assistant", "turnId": f"seed_{turn}",
             "parts": [{"type": "tool-call", "toolCallId": call, "toolName": "shell", "input": {"cmd": f"cat log{i}"}}]}
        t = {"id": f"msg_seed_{turn:05d}_{i:02d}t", "parentId": a["id"], "role": "tool", "turnId": f"seed_{turn}",
             "parts": [{"type": "tool-result", "toolCallId": call, "toolName": "shell",
                        "output": {"type": "text", "value": f"log {turn}.{i}: " + "steady state, nothing new. " * 22}}]}
        out += [a, t]
        prev = t["id"]
    out.append({"id": f"msg_seed_{turn:05d}_z", "parentId": prev, "role": "assistant", "turnId": f"seed_{turn}",
                "parts": [{"type": "text", "text": f"seeded turn {turn}: nothing new in the logs"}]})
    return user, out


async def seed(rpc: RpcClient, cid: str, messages: int, progress: Progress) -> str:
    turns = messages // SEED_MESSAGES_PER_TURN
    task = progress.add_task(f"turn start: seed {messages:,} messages", total=turns)
    parent: str | None = None
    for k in range(turns):
        user, rest = seeded_turn(k, parent)
        await rpc.call("ctx.persist.append", {"streamId": f"conversation:{cid}", "expectedVersion": None, "events": [
            {"eventId": str(uuid.uuid4()), "type": "UserMessageAdded", "data": {"message": user}}]})
        await rpc.call("ctx.persist.complete_turn", {"conversationId": cid, "turnId": f"seed_{k}",
                                                     "eventId": str(uuid.uuid4()), "messages": rest}, timeout=120)
        parent = rest[-1]["id"]
        progress.advance(task)
    return parent or ""


async def prepared(api: Api, rpc: RpcClient, messages: int, progress: Progress) -> dict[str, Any]:
    """A conversation of ``messages`` seeded messages whose first real turn has folded the old history."""
    cid = await api.conversation(f"history-{messages}")
    await seed(rpc, cid, messages, progress)
    t0 = time.perf_counter()
    _, events = await api.turn(cid, "what changed since yesterday?", [{"text": "nothing new"}])
    first_ms = next((e["data"].get("durationMs") for e in events if e["type"] == "CompactionDecided"
                     and e["data"].get("phase") == "turn-start"), None)
    return {"cid": cid, "leaf": (await api.messages(cid))[-1]["id"], "historyMessages": messages + 2,
            "first_turn_start_ms": first_ms, "first_turn_seconds": round(time.perf_counter() - t0, 2)}


async def turn_starts(api: Api, rpc: RpcClient, sizes: list[int], repeats: int, progress: Progress
                      ) -> dict[str, dict[str, Any]]:
    """Turn-start round trips for each history size, interleaved call by call (1k, 10k, 1k, 10k, …) so that
    both see the same machine load; the median of each."""
    convs = {n: await prepared(api, rpc, n, progress) for n in sizes}
    settings = {"contextWindow": WINDOW, "compressEnabled": True}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    replies: dict[int, dict[str, Any]] = {}
    task = progress.add_task("turn start: interleaved calls", total=repeats * len(sizes))
    for _ in range(repeats):
        for n in sizes:
            c = convs[n]
            t = time.perf_counter()
            replies[n] = await rpc.call("ctx.compact.turn_start", {"conversationId": c["cid"], "anchorId": c["leaf"],
                                                                   "settings": settings}, timeout=300)
            times[n].append((time.perf_counter() - t) * 1000)
            progress.advance(task)
    return {str(n): {"historyMessages": convs[n]["historyMessages"],
                     "turn_start_ms": round(statistics.median(times[n]), 2),
                     "turn_start_ms_all": [round(x, 2) for x in times[n]],
                     "decision": replies[n]["decision"]["status"], "servedMessages": len(replies[n]["messages"]),
                     "first_turn_start_ms": convs[n]["first_turn_start_ms"],
                     "first_turn_seconds": convs[n]["first_turn_seconds"]} for n in sizes}


# ---------------------------------------------------------------- 3. events

async def largest_event(database_url: str) -> dict[str, Any]:
    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow(
            "SELECT type, octet_length(data::text) + octet_length(metadata::text) AS bytes FROM persistence.events "
            "ORDER BY bytes DESC LIMIT 1")
        count = await conn.fetchval("SELECT count(*) FROM persistence.events")
    finally:
        await conn.close()
    return {"max_event_bytes": row["bytes"] if row else 0, "largestEventType": row["type"] if row else None,
            "events": count}


# ---------------------------------------------------------------- main

async def measure(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    api = Api(stack.env["CTX_ORCHESTRATION_HTTP"], stack.env["CTX_API_KEY"])
    broker = NatsBroker(stack.env["CTX_NATS_URL"], logger=None)
    await broker.connect()
    rpc = RpcClient(broker, default_timeout=120)
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    out: dict[str, Any] = {}
    try:
        with Progress(*cols) as progress:
            out["volume"] = await volume(api, args.turns, progress)
            out["turnStart"] = await turn_starts(api, rpc, [1_000, 10_000], args.repeats, progress)
        out["events"] = await largest_event(stack.env["CTX_DATABASE_URL"])
    finally:
        await api.aclose()
        await broker.stop()
    return out


def check(result: dict[str, Any]) -> list[str]:
    missed = []
    for key, (op, target) in TARGETS.items():
        value = result[key]
        ok = value is not None and {"==": value == target, ">=": value >= target, "<=": value <= target}[op]
        if not ok:
            missed.append(f"{key} {value} (target {op} {target})")
    return missed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "scale.json")
    ap.add_argument("--turns", type=int, default=50, help="turns of the volume conversation")
    ap.add_argument("--repeats", type=int, default=21, help="turn-start calls measured per history size")
    args = ap.parse_args()
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    with private_stack("ctxbuild-bench-scale-") as stack:
        detail = asyncio.run(measure(stack, args))
    ts = detail["turnStart"]
    small, large = ts["1000"]["turn_start_ms"], ts["10000"]["turn_start_ms"]
    result = {
        "benchmark": "scale",
        "bricked_conversations": int(detail["volume"]["bricked"]),
        "largest_history_bytes": detail["volume"]["historyBytes"],
        "turn_start_ms": {"1000": small, "10000": large},
        "turn_start_growth": round(large / small, 3) if small else None,
        "max_event_bytes": detail["events"]["max_event_bytes"],
        **detail,
        "targets": {k: f"{op} {v}" for k, (op, v) in TARGETS.items()},
        "seconds": round(time.perf_counter() - t0, 1),
        "environment": {"python": platform.python_version(), "cpus": os.cpu_count(), "loadavg_before": load_before,
                        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "window": WINDOW},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps({k: result[k] for k in ("bricked_conversations", "largest_history_bytes", "turn_start_ms",
                                             "turn_start_growth", "max_event_bytes")}, indent=2))
    missed = check(result)
    if missed:
        sys.exit(f"scale targets missed: {'; '.join(missed)} — see {args.out}")


if __name__ == "__main__":
    main()
