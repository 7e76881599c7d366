"""End-to-end benchmark (`make bench-e2e` → bench/results/e2e.json): real agent trajectories replayed through the
full running stack.

How it runs: a private stack in a temporary directory (NATS JetStream, Postgres with fsync on, SeaweedFS S3 and the
six services as processes, ``ctxbuild_devstack.Stack``). Every turn goes through the orchestration HTTP API
(POST …/turns with a ``replay`` provider whose script carries the recorded decisions and the recorded FULL tool
outputs); the pipeline does the rest — turn-start and in-loop compaction (the default offline ``extractive``
summarizer), the in-flight lane, blob offloads, the event log, the persist lane. Nothing is mocked; only the model
is a replay. Turns are awaited over the SSE endpoint as a front end would; afterwards each step's served request
is fetched (GET …/steps/{n}/request, checked against StepServed.requestHash) and trimmed outputs are read back
(GET …/messages/{mid}/results/{callId}).

Trajectories (../shared/data/trajectories; the bench skips cleanly — exit 0, a JSON saying why — when absent):
SWE-agent (1 turn, 12 model calls), mini-swe-agent (1 turn, 80 calls, outputs up to 110,817 chars), tau-bench
(5 episodes, each one conversation of 4–8 turns), and STORM web research (06_storm_*: one conversation of its 12
dialogue turns; each query a ``web_search`` call whose recorded output is the entities shape
``{"type":"json","value":[{id,title,url,content}…]}``, SPEC §4). All conversations use a 32k context window
(``--window``); the STORM one also sets ``truncateThreshold`` 2,000 (SPEC minimum) so the entities codec actually
trims web content: at the 32k default (9,600 chars in flight) no single search result is long enough.

Per trajectory (definitions also in the JSON):
- steps; raw history tokens per step (the untrimmed history up to that step — every previous message with the
  recorded full tool outputs, messages only, the shared cl100k counter) vs tokens served per step
  (StepServed.servedTokens, same counter): mean and max;
- prefix_stability: share of eligible steps (k ≥ 2 of a turn, no CompactionDecided/InLoopFoldRecorded at step k)
  whose request is a byte-prefix extension of request k-1 (system + tools byte-equal; each of request k-1's
  messages byte-equal, as compact JSON, to the same position of request k);
- orphaned tool calls/results over all served requests and over the persisted history (target 0);
- citation skeletons intact (web results): every recorded id/title/url of every web_search result present in a
  served request or in the persisted messages (target 100%);
- recoverable: every ToolResultRecorded with trimmed=true read back equals the recorded original byte for byte
  (the text, or for entities the JSON value) (target 100%);
- pipeline overhead per step: recordedAt(StepServed k) − recordedAt(StepServed k−1) − modelMs(k) (replayed tools
  take ~0): median and p99, per trajectory and overall; turns run one at a time here.
Throughput: 16 concurrent turns (copies of the SWE-agent turn, each in its own conversation; ``--batches`` batches
one after another) through the stack's single orchestration process (``CTX_MAX_CONCURRENT_TURNS`` 16) → turns/s,
beside the same turn run one at a time; the pipeline overhead under that load is reported there too.
Replicas: turns/s of ``--scale-concurrency`` (16) concurrent copies of the same turn through an edge and 1 or 2
runner replicas (orchestration processes with CTX_ROLE=runner on their own work-queue stream), with 1 or 2
persistence replicas (a second process in its queue group); the four configurations visited in order and back
(``--scale-rounds``), one batch per visit, beside CPU seconds per turn by component (runners, edge, persistence,
Postgres, NATS, each other process), events and WAL bytes per turn, and the CPU an open SSE stream costs per second
with nothing to send (turns queued with no runner, followed; less the same window unfollowed) — the per-core
figures docs/scaling.md projects from.
Kill test: a separate edge and runner replicas on their own work-queue stream (ack wait 3 s); replayed turns
(≥ 5 model calls) run two at a time while the runner is SIGKILLed ``--kills`` times at a random moment (0–0.6 s)
after it served a step of a running turn, a new runner started after each; each turn is hit at most 3 times (the
runner fails a turn delivered more than 5 times as poison). At the end every turn must have exactly one terminal
event, TurnCompleted, one StepServed per step, and a consistent history (each message once, the script's number
of messages, no orphan); requests served after a resume are checked for prefix stability too.

    .venv/bin/python bench/e2e.py --out bench/results/e2e.json
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import random
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from ctxbuild_codec import compaction_budget, inflight_threshold
from ctxbuild_codec.tokens import count_message, count_messages
from ctxbuild_devstack import Stack, private_stack
from ctxbuild_devstack.replica import Replica
from ctxbuild_orchestration.domain.turn_state import message_id
from ctxbuild_providers.trajectories import Trajectory, episode_count, load_trajectory
from e2e_metrics import (
    WEB_SEARCH_TOOL,
    CitationCheck,
    check_citations,
    compaction_steps,
    duplicate_call_ids,
    history_problems,
    mean_max,
    orphan_count,
    prefix_extends,
    recorded_output,
    same_output,
    served_steps,
    step_overheads,
    storm_turns,
    summary_ms,
    terminal_types,
    untrimmed_steps,
)
from httpx_sse import aconnect_sse
from proc_cpu import delta, snapshot
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
TRAJ = SHARED / "trajectories"
SWE = TRAJ / "01_sweagent_marshmallow-1867_function_calling.traj"
MINI = TRAJ / "03_miniswe_deepseek-chat_sqlfluff-1733.traj.json"
TAU = TRAJ / "05_taubench_gpt-4o-airline_subset.json"
STORM = TRAJ / "06_storm_websearch_CRW_telesystem" / "conversation_log.json"
STORM_TRUNCATE = 2_000
TURN_TIMEOUT_S = 300.0

# the kill test's own work queue (subjects of two streams may not overlap, hence its own subject too)
KILL_STREAM, KILL_SUBJECT, KILL_CONSUMER, KILL_ACK_WAIT = "CTX_TURNS_BENCH_E2E", "ctx.turn.run_bench_e2e", \
    "bench-e2e-runner", "3"
MAX_HITS_PER_TURN = 3

DEFINITIONS = {
    "rawHistoryTokens": "tokens (shared cl100k counter, messages only) of the untrimmed history up to the step: "
                        "every earlier message of the conversation with the recorded FULL tool outputs",
    "servedTokens": "StepServed.servedTokens: tokens of the messages the model was served (same counter)",
    "prefix_stability": "share of eligible steps (k >= 2 of a turn, no CompactionDecided/InLoopFoldRecorded at "
                        "step k) whose served request is a byte-prefix extension of request k-1: system and tools "
                        "byte-equal, and each of request k-1's messages byte-equal (compact JSON) to the message at "
                        "the same position of request k",
    "orphans": "tool calls with no later result answering them plus results answering no earlier open call, "
               "summed over every served request (and, separately, over the persisted history)",
    "citations": "for each web_search result in a served request or the persisted messages: each recorded item's "
                 "id present once with title and url byte-equal to the recording (content may be trimmed)",
    "recoverable": "ToolResultRecorded with trimmed=true whose read-back (GET …/messages/{mid}/results/{callId}) "
                   "equals the recorded original: the same text byte for byte, or the same JSON value",
    "pipelineOverhead": "recordedAt(StepServed k) - recordedAt(StepServed k-1) - StepServed.modelMs(k), for "
                        "consecutive steps of one turn; includes tool execution (replayed: ~0), truncation, "
                        "blob offloads, event appends and in-loop compaction",
    "throughput": "turns per second of wall time from the first POST …/turns to the last terminal event of a "
                  "batch of 16 turns submitted at once (batches run one after another, wall times summed)",
    "scaling": "turns per second of wall time of batches of --scale-concurrency turns submitted at once, with 1 or 2 "
               "runner replicas and 1 or 2 persistence replicas; cpu_s_per_turn: user+system CPU seconds of each "
               "component over those batches / turns",
    "requestsWithDuplicateToolCallIds": "served requests in which one tool-call id occurs twice (the runner gives "
                                        "each replayed turn its own call-id prefix, so this should be 0; the "
                                        "orphan metric pairs calls and results in order either way)",
}


# ---------------------------------------------------------------- processes

class Api:
    def __init__(self, base: str, api_key: str) -> None:
        self.base = base
        self.http = httpx.AsyncClient(base_url=base, timeout=120, headers={"Authorization": f"Bearer {api_key}"})

    async def aclose(self) -> None:
        await self.http.aclose()

    async def conversation(self, title: str, settings: dict[str, Any]) -> str:
        r = await self.http.post("/v1/conversations", json={"title": title, "settings": settings})
        r.raise_for_status()
        return r.json()["id"]

    async def start_turn(self, cid: str, text: str, provider: dict[str, Any], max_steps: int) -> str:
        r = await self.http.post(f"/v1/conversations/{cid}/turns",
                                 json={"text": text, "provider": provider, "maxSteps": max_steps})
        if r.status_code != 202:
            raise RuntimeError(f"turn refused ({r.status_code}): {r.text[:500]}")
        return r.json()["turnId"]

    async def wait(self, cid: str, tid: str, timeout: float = TURN_TIMEOUT_S) -> None:
        """Follow the turn's SSE stream (as a front end does) until its terminal event."""
        async def follow() -> None:
            last: str | None = None
            while True:
                headers = {"Last-Event-ID": last} if last else {}
                try:
                    async with aconnect_sse(self.http, "GET", f"/v1/conversations/{cid}/turns/{tid}/events",
                                            headers=headers, timeout=httpx.Timeout(30, read=None)) as src:
                        async for ev in src.aiter_sse():
                            last = ev.id or last
                            if ev.event in ("TurnCompleted", "TurnFailed"):
                                return
                except httpx.HTTPError:
                    await asyncio.sleep(0.5)  # the edge hiccupped: resume from the last event seen

        await asyncio.wait_for(follow(), timeout)

    async def turn(self, cid: str, tid: str) -> dict[str, Any]:
        r = await self.http.get(f"/v1/conversations/{cid}/turns/{tid}")
        r.raise_for_status()
        return r.json()

    async def request(self, cid: str, tid: str, step: int) -> tuple[bytes, str | None]:
        r = await self.http.get(f"/v1/conversations/{cid}/turns/{tid}/steps/{step}/request")
        r.raise_for_status()
        return r.content, r.headers.get("x-request-hash")

    async def messages(self, cid: str) -> list[dict[str, Any]]:
        r = await self.http.get(f"/v1/conversations/{cid}/messages")
        r.raise_for_status()
        return r.json()["messages"]

    async def result(self, cid: str, mid: str, call_id: str) -> dict[str, Any]:
        r = await self.http.get(f"/v1/conversations/{cid}/messages/{mid}/results/{call_id}")
        r.raise_for_status()
        return r.json()


# ---------------------------------------------------------------- the trajectories

def storm_trajectory() -> tuple[Trajectory, dict[str, dict[str, Any]]]:
    from ctxbuild_providers.trajectories import ReplayTurn

    turns, recorded = storm_turns(json.loads(STORM.read_text(encoding="utf-8")))
    return Trajectory(STORM.parent.name, "storm-websearch", None, [WEB_SEARCH_TOOL],
                      [ReplayTurn(text, script) for text, script in turns]), recorded


def replay_set() -> list[dict[str, Any]]:
    """The conversations to replay: (label, trajectory, settings, recorded web items)."""
    out = [{"label": "swe-agent", "traj": load_trajectory(SWE)},
           {"label": "mini-swe-agent", "traj": load_trajectory(MINI)}]
    for e in range(episode_count(TAU)):
        out.append({"label": f"tau-bench#{e}", "traj": load_trajectory(TAU, e)})
    storm, recorded = storm_trajectory()
    out.append({"label": "storm-websearch", "traj": storm, "recorded": recorded,
                "settings": {"truncateThreshold": STORM_TRUNCATE}})
    return out


# ---------------------------------------------------------------- one conversation, turn by turn

async def replay_conversation(api: Api, item: dict[str, Any], window: int, progress: Progress, task: Any
                              ) -> dict[str, Any]:
    traj: Trajectory = item["traj"]
    recorded_web: dict[str, dict[str, Any]] | None = item.get("recorded")
    settings = {"contextWindow": window, **item.get("settings", {})}
    cid = await api.conversation(item["label"], settings)
    raw_history: list[dict[str, Any]] = []
    raw_tokens_base = 0
    raw_tokens: list[int] = []
    served_tokens: list[int] = []
    overheads: list[float] = []
    eligible = stable = 0
    unstable: list[str] = []
    request_orphans = 0
    dup_id_requests = 0
    hash_mismatches = 0
    citations = CitationCheck()
    trimmed = recovered = 0
    not_recovered: list[str] = []
    decisions: dict[str, int] = {}  # CompactionDecided phase:status[:reason] → count
    failed: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for j, turn in enumerate(traj.turns):
        spec = traj.replay_spec(j)
        tid = await api.start_turn(cid, turn.text, spec, len(turn.script))
        await api.wait(cid, tid)
        log = await api.turn(cid, tid)
        events = log["events"]
        ends = terminal_types(events)
        if ends != ["TurnCompleted"]:
            failed.append({"turn": j, "terminal": ends, "error": log.get("error")})
        compacted = compaction_steps(events)
        for e in events:
            if e["type"] != "CompactionDecided":
                continue
            d = e["data"]
            key = f"{d.get('phase')}:{d.get('status')}" + (f":{d['reason']}" if d.get("status") != "done" else "")
            decisions[key] = decisions.get(key, 0) + 1
        added = untrimmed_steps(events, turn.script)
        user = {"role": "user", "parts": [{"type": "text", "text": turn.text}]}
        base = raw_tokens_base + count_message(user)
        prev: dict[str, Any] | None = None
        for served in served_steps(events):
            k = served["step"]
            body, header_hash = await api.request(cid, tid, k)
            if hashlib.sha256(body).hexdigest() != served["requestHash"] or header_hash != served["requestHash"]:
                hash_mismatches += 1
            req = json.loads(body)
            served_tokens.append(served["servedTokens"])
            raw_tokens.append(base + sum(count_messages(added[s]) for s in range(1, k) if s in added))
            request_orphans += orphan_count(req["messages"])
            dup_id_requests += bool(duplicate_call_ids(req["messages"]))
            if recorded_web is not None:
                citations.add(check_citations(req["messages"], recorded_web))
            if prev is not None and k not in compacted:
                eligible += 1
                if prefix_extends(prev, req):
                    stable += 1
                elif len(unstable) < 10:
                    unstable.append(f"turn {j} step {k}")
            prev = req
            progress.advance(task)
        overheads += [ms for _, ms in step_overheads(events)]
        raw_history += [user, *[m for s in sorted(added) for m in added[s]]]
        raw_tokens_base = count_messages(raw_history)
        # trimmed outputs, read back in full from what was persisted
        for e in events:
            d = e["data"]
            if e["type"] != "ToolResultRecorded" or not d.get("trimmed"):
                continue
            original = recorded_output(turn.script, d["toolCallId"])
            if original is None:
                continue  # executed, not recorded: nothing to compare against
            trimmed += 1
            back = await api.result(cid, message_id(tid, d["step"], "t"), d["toolCallId"])
            if same_output(original, back["output"]):
                recovered += 1
            elif len(not_recovered) < 10:
                not_recovered.append(f"turn {j} {d['toolCallId']} (source {back.get('source')})")
    seconds = time.perf_counter() - t0
    persisted = await api.messages(cid)
    out: dict[str, Any] = {
        "file": traj.name, "format": traj.format, "turns": len(traj.turns), "steps": len(served_tokens),
        "settings": settings,
        "rawHistoryTokensPerStep": mean_max(raw_tokens),
        "servedTokensPerStep": mean_max(served_tokens),
        "servedOverRawTotal": round(sum(served_tokens) / sum(raw_tokens), 4) if raw_tokens else None,
        "prefix_stability": round(stable / eligible, 4) if eligible else None,
        "prefixEligibleSteps": eligible, "prefixStableSteps": stable, "prefixBrokenAt": unstable,
        "compactionDecisions": dict(sorted(decisions.items())),
        "orphansInServedRequests": request_orphans,
        "orphansInPersistedHistory": orphan_count(persisted),
    "requestsWithDuplicateToolCallIds": dup_id_requests,
        "requestHashMismatches": hash_mismatches,
        "trimmedResults": trimmed, "recoverable": recovered,
        "recoverableShare": round(recovered / trimmed, 4) if trimmed else None,
        "notRecovered": not_recovered,
        "pipelineOverhead": summary_ms(overheads),
        "failedTurns": failed,
        "seconds": round(seconds, 1),
        "_overheads": overheads, "_raw": raw_tokens, "_served": served_tokens,
    }
    if recorded_web is not None:
        persisted_check = check_citations(persisted, recorded_web)
        out["citations"] = {"recordedResults": len(recorded_web),
                            "servedRequests": citations.as_dict(), "persistedMessages": persisted_check.as_dict()}
    return out


# ---------------------------------------------------------------- throughput

async def run_batch(api: Api, traj: Trajectory, turn: int, n: int, window: int) -> dict[str, Any]:
    """``n`` copies of one replayed turn (one conversation each) submitted at once; wall time to the last end."""
    cids = [await api.conversation(f"throughput {i}", {"contextWindow": window}) for i in range(n)]
    spec, script = traj.replay_spec(turn), traj.turns[turn].script
    t0 = time.perf_counter()
    tids = await asyncio.gather(*(api.start_turn(c, traj.turns[turn].text, spec, len(script)) for c in cids))
    await asyncio.gather(*(api.wait(c, t) for c, t in zip(cids, tids, strict=True)))
    wall = time.perf_counter() - t0
    logs = [await api.turn(c, t) for c, t in zip(cids, tids, strict=True)]
    return {"turns": n, "completed": sum(terminal_types(log["events"]) == ["TurnCompleted"] for log in logs),
            "steps": sum(len(served_steps(log["events"])) for log in logs), "wall_s": wall,
            "overheads": [ms for log in logs for _, ms in step_overheads(log["events"])]}


def rates(batches: list[dict[str, Any]]) -> dict[str, Any]:
    turns = sum(b["turns"] for b in batches)
    steps = sum(b["steps"] for b in batches)
    wall = sum(b["wall_s"] for b in batches)
    return {"turns": turns, "completed": sum(b["completed"] for b in batches), "steps": steps,
            "wall_s": round(wall, 3), "turns_per_s": round(turns / wall, 3), "steps_per_s": round(steps / wall, 2),
            "pipelineOverhead": summary_ms([x for b in batches for x in b["overheads"]])}


async def throughput(api: Api, traj: Trajectory, window: int, concurrency: int, batches: int, sequential: int,
                     progress: Progress, task: Any) -> dict[str, Any]:
    one, many = [], []
    for _ in range(sequential):
        one.append(await run_batch(api, traj, 0, 1, window))
        progress.advance(task)
    for _ in range(batches):
        many.append(await run_batch(api, traj, 0, concurrency, window))
        progress.advance(task)
    alone, many = rates(one), rates(many)
    return {"turn": f"{traj.name} turn 0 ({len(traj.turns[0].script)} model calls), one conversation per turn",
            "concurrency": concurrency, "batches": batches, "concurrent": many, "oneAtATime": alone,
            "speedup_vs_one_at_a_time": round(many["turns_per_s"] / alone["turns_per_s"], 2)}


# ---------------------------------------------------------------- replicas: turns/s with 1 and 2 runners, persistence

SCALE_QUEUE = {"CTX_TURNS_STREAM": "CTX_TURNS_BENCH_SCALE", "CTX_TURNS_SUBJECT": "ctx.turn.run_bench_scale",
               "CTX_TURNS_CONSUMER": "bench-scale-runner"}
SCALE_CONFIGS = [(1, 1), (2, 1), (2, 2), (1, 2)]  # (runner replicas, persistence replicas): one start/stop per move


class Replicas:
    """An edge and runner replicas on their own work-queue stream (the stack's own orchestration process stays
    off it), plus extra persistence replicas in the service's queue group; grown and shrunk between batches."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.runners: list[Replica] = []
        self.persistence: list[Replica] = []
        self.started = 0

    async def _start(self, service: str, name: str, **env: str) -> Replica:
        self.started += 1
        r = Replica(self.stack, service, f"{name}-{self.started}", **env)
        return await asyncio.to_thread(r.wait_ready, 90)

    async def open(self) -> Api:
        self.edge = await self._start("orchestration", "bench-scale-edge", CTX_ROLE="edge", **SCALE_QUEUE)
        return Api(self.edge.url, self.stack.env["CTX_API_KEY"])

    async def resize(self, runners: int, persistence: int) -> None:
        while len(self.runners) < runners:
            self.runners.append(await self._start("orchestration", "bench-scale-runner", CTX_ROLE="runner",
                                                  **SCALE_QUEUE))
        while len(self.runners) > runners:
            await asyncio.to_thread(self.runners.pop().stop)
        while 1 + len(self.persistence) < persistence:
            self.persistence.append(await self._start("persistence", "bench-scale-persistence"))
        while 1 + len(self.persistence) > persistence:
            await asyncio.to_thread(self.persistence.pop().stop)

    def cpu_groups(self) -> dict[str, list[int]]:
        """Where the cores go, by component: the runners, the edge, persistence (all replicas), and each other
        process of the stack by name (its own orchestration process sits idle, off this work queue)."""
        groups = {name: [info["pid"]] for name, info in self.stack.procs.items()}
        groups["persistence"] += [r.proc.pid for r in self.persistence]
        groups["orchestration_idle"] = groups.pop("orchestration")
        return {"runners": [r.proc.pid for r in self.runners], "edge": [self.edge.proc.pid], **groups}

    async def close(self) -> None:
        await self.resize(0, 1)
        await asyncio.to_thread(self.edge.stop)


async def db_marks(db: asyncpg.Connection) -> tuple[int, int]:
    """The last event position and the WAL insert position in bytes (every database of the stack: events, blob
    metadata)."""
    row = await db.fetchrow("SELECT (SELECT coalesce(max(position), 0) FROM persistence.events) AS pos, "
                            "pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint AS wal")
    return int(row["pos"]), int(row["wal"])


async def follow_cost(api: Api, reps: Replicas, traj: Trajectory, window: int, n: int, seconds: float = 8.0
                      ) -> dict[str, Any]:
    """CPU per followed turn per second while nothing happens: ``n`` turns queued with no runner, each followed
    over SSE as a front end does, for ``seconds`` (the edge reads the turn's stream on a timer between wake-ups),
    less the same window with nobody following (the services' own pollers); then a runner is started and the
    turns complete."""
    await reps.resize(0, 1)
    cids = [await api.conversation(f"follow {i}", {"contextWindow": window}) for i in range(n)]
    spec, script = traj.replay_spec(0), traj.turns[0].script
    tids = await asyncio.gather(*(api.start_turn(c, traj.turns[0].text, spec, len(script)) for c in cids))
    groups = reps.cpu_groups()
    c0 = snapshot(groups)
    t0 = time.perf_counter()
    await asyncio.sleep(seconds)
    idle, idle_wall = delta(c0, snapshot(groups)), time.perf_counter() - t0
    followers = [asyncio.ensure_future(api.wait(c, t, timeout=seconds + 4)) for c, t in zip(cids, tids, strict=True)]
    await asyncio.sleep(2)  # connected and authenticated (an API key's first check is an argon2 hash): not counted
    c0 = snapshot(groups)
    t0 = time.perf_counter()
    await asyncio.sleep(seconds)
    wall = time.perf_counter() - t0
    used = delta(c0, snapshot(groups))
    ended = await asyncio.gather(*followers, return_exceptions=True)
    if not all(isinstance(e, TimeoutError) for e in ended):
        raise RuntimeError(f"a followed turn ended with no runner: {ended}")
    await reps.resize(1, 1)
    await asyncio.gather(*(api.wait(c, t) for c, t in zip(cids, tids, strict=True)))
    net = {k: (used[k] - idle[k] * wall / idle_wall) / (n * wall) * 1000 for k in used}
    return {"turns": n, "seconds": round(wall, 2),
            "cpu_ms_per_followed_turn_second": {k: round(v, 3) for k, v in net.items() if abs(v) >= 0.05},
            "cpu_ms_per_followed_turn_second_total": round(sum(net.values()), 3),
            "idle_cpu_cores": round(sum(idle.values()) / idle_wall, 3),
            "how": "turns queued with no runner, each followed over GET …/turns/{id}/events for the window: the "
                   "CPU spent per open SSE stream per second with no event to send, less the same window with no "
                   "follower (idle_cpu_cores: the services' own pollers)"}


async def scaling(stack: Stack, traj: Trajectory, window: int, concurrency: int, rounds: int, progress: Progress,
                  task: Any) -> dict[str, Any]:
    """turns/s of ``concurrency`` concurrent copies of one replayed turn with each (runners, persistence) replica
    count; the configurations visited in order and back again each round (drift hits them alike), one batch per
    visit; CPU seconds per turn by component and events appended per turn over the same batches."""
    reps = Replicas(stack)
    api = await reps.open()
    db = await asyncpg.connect(stack.env["CTX_DATABASE_URL"])
    per: dict[tuple[int, int], dict[str, Any]] = {c: {"batches": [], "cpu": {}, "events": 0, "wal": 0}
                                                  for c in SCALE_CONFIGS}
    try:
        await reps.resize(1, 1)
        await run_batch(api, traj, 0, 4, window)  # warm-up: the runner's first turns, prepared statements
        for r in range(rounds):
            for cfg in SCALE_CONFIGS if r % 2 == 0 else SCALE_CONFIGS[::-1]:
                await reps.resize(*cfg)
                await asyncio.sleep(1)  # a new replica's consumers and pollers settle
                groups = reps.cpu_groups()
                c0, (e0, w0) = snapshot(groups), await db_marks(db)
                batch = await run_batch(api, traj, 0, concurrency, window)
                used = delta(c0, snapshot(groups))
                e1, w1 = await db_marks(db)
                per[cfg]["events"] += e1 - e0
                per[cfg]["wal"] += w1 - w0
                per[cfg]["batches"].append(batch)
                for k, v in used.items():
                    per[cfg]["cpu"][k] = per[cfg]["cpu"].get(k, 0.0) + v
                progress.advance(task)
        follow = await follow_cost(api, reps, traj, window, concurrency)
    finally:
        await db.close()
        await api.aclose()
        await reps.close()
    out: dict[str, Any] = {}
    for (runners, persistence), d in per.items():
        rate = rates(d["batches"])
        turns = rate["turns"]
        out[f"runners_{runners}_persistence_{persistence}"] = {
            "runners": runners, "persistence": persistence, **rate,
            "events_per_turn": round(d["events"] / turns, 1), "events_per_s": round(d["events"] / rate["wall_s"], 1),
            "wal_bytes_per_turn": round(d["wal"] / turns),
            "cpu_s_per_turn": {k: round(v / turns, 4) for k, v in d["cpu"].items()},
            "cpu_s_per_turn_total": round(sum(d["cpu"].values()) / turns, 4),
            "cores_busy": round(sum(d["cpu"].values()) / rate["wall_s"], 2),
        }
    base = out["runners_1_persistence_1"]["turns_per_s"]
    return {"turn": f"{traj.name} turn 0 ({len(traj.turns[0].script)} model calls), one conversation per turn",
            "concurrency": concurrency, "rounds": rounds, "configs": out, "sse_follow": follow,
            "speedup_vs_1_1": {k: round(v["turns_per_s"] / base, 3) for k, v in out.items()},
            "how": "an edge and 1 or 2 runner replicas on their own work-queue stream, 1 or 2 persistence "
                   f"replicas; each visit of a configuration runs one batch of {concurrency} turns submitted at "
                   "once; turns/s = turns / summed wall time; CPU = psutil user+system seconds of each component "
                   "over the batches (the bench process itself — HTTP, SSE — not counted); events = persistence.events "
                   "positions appended over the batches"}


# ---------------------------------------------------------------- the kill test

def kill_pool() -> list[tuple[str, str, dict[str, Any], list[dict[str, Any]]]]:
    """Replayed turns long enough to be killed in the middle (≥ 5 model calls): (label, text, spec, script)."""
    pool = []
    candidates = [("swe-agent", load_trajectory(SWE))] + \
        [(f"tau-bench#{e}", load_trajectory(TAU, e)) for e in range(episode_count(TAU))]
    for label, traj in candidates:
        for j, t in enumerate(traj.turns):
            if len(t.script) >= 5:
                pool.append((f"{label} turn {j}", t.text, traj.replay_spec(j), t.script))
    return pool


async def kill_test(stack: Stack, kills: int, window: int, seed: int, progress: Progress, task: Any
                    ) -> dict[str, Any]:
    rng = random.Random(seed)
    queue_env = {"CTX_TURNS_STREAM": KILL_STREAM, "CTX_TURNS_SUBJECT": KILL_SUBJECT,
                 "CTX_TURNS_CONSUMER": KILL_CONSUMER, "CTX_TURN_ACK_WAIT_S": KILL_ACK_WAIT}
    edge = await asyncio.to_thread(
        lambda: Replica(stack, "orchestration", "bench-edge", CTX_ROLE="edge", **queue_env).wait_ready(90))
    api = Api(edge.url, stack.env["CTX_API_KEY"])
    runners: list[Replica] = []

    async def new_runner() -> Replica:
        r = Replica(stack, "orchestration", f"bench-runner-{len(runners) + 1}", CTX_ROLE="runner",
                    **queue_env)
        runners.append(r)
        return await asyncio.to_thread(r.wait_ready)

    pool = kill_pool()
    rng.shuffle(pool)
    turns: list[dict[str, Any]] = []  # {label, cid, tid, script, hits}
    next_turn = 0

    async def submit() -> None:
        nonlocal next_turn
        label, text, spec, script = pool[next_turn % len(pool)]
        next_turn += 1
        cid = await api.conversation(f"kill {label}", {"contextWindow": window})
        tid = await api.start_turn(cid, text, spec, len(script))
        turns.append({"label": label, "cid": cid, "tid": tid, "script": script, "hits": 0})

    async def state(t: dict[str, Any]) -> tuple[bool, int]:
        evs = (await api.turn(t["cid"], t["tid"]))["events"]
        return bool(terminal_types(evs)), len(served_steps(evs))

    killed_mid_turn = attempts = 0
    kill_times: list[float] = []
    runner = await new_runner()
    t0 = time.perf_counter()
    try:
        while killed_mid_turn < kills and attempts < kills * 4:
            live = [t for t in turns if not (await state(t))[0]]
            while len(live) < 2:
                await submit()
                live.append(turns[-1])
            if any(t["hits"] >= MAX_HITS_PER_TURN for t in live):
                # a turn that has taken its share of kills finishes in peace (the runner fails a turn delivered
                # more than 5 times as poison — a crash loop, which this test is not about)
                await asyncio.gather(*(api.wait(t["cid"], t["tid"]) for t in live if t["hits"] >= MAX_HITS_PER_TURN))
                continue
            # wait until this runner has served a step of a live turn, then a random moment more
            base = {t["tid"]: (await state(t))[1] for t in live}
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                states = {t["tid"]: await state(t) for t in live}
                if any(done for done, _ in states.values()) or \
                        any(n > base[tid] for tid, (_, n) in states.items()):
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(rng.uniform(0.0, 0.6))
            attempts += 1
            runner.kill()
            kill_times.append(time.time())
            hit = [t for t in live if not (await state(t))[0]]
            for t in hit:
                t["hits"] += 1
            if hit:
                killed_mid_turn += 1
                progress.advance(task)
            runner = await new_runner()
        for t in turns:
            await api.wait(t["cid"], t["tid"], timeout=TURN_TIMEOUT_S)
        wall = time.perf_counter() - t0
        report = []
        resume_after_kill: list[float] = []
        eligible = stable = across = across_stable = request_orphans = 0
        for t in turns:
            evs = (await api.turn(t["cid"], t["tid"]))["events"]
            steps = [d["step"] for d in served_steps(evs)]
            results = [e["data"]["toolCallId"] for e in evs if e["type"] == "ToolResultRecorded"]
            problems = history_problems(await api.messages(t["cid"]), t["tid"], t["script"])
            if steps != list(range(1, len(t["script"]) + 1)):
                problems.append(f"StepServed steps {steps}")
            if len(results) != len(set(results)):
                problems.append("a tool result recorded twice")
            # a resumed turn serves the bytes the first runner would have: request k extends request k-1 even
            # when another replica served k-1
            compacted, resumed_before, prev, seen_resume = compaction_steps(evs), set(), None, False
            for e in evs:
                if e["type"] == "TurnResumed":
                    seen_resume = True
                    started = datetime.fromisoformat(e["recordedAt"]).timestamp()
                    before = [k for k in kill_times if k <= started]
                    if before:
                        resume_after_kill.append(started - before[-1])
                elif e["type"] == "StepServed":
                    if seen_resume:
                        resumed_before.add(e["data"]["step"])
                    seen_resume = False
            turn_orphans = 0
            for k in steps:
                body, _ = await api.request(t["cid"], t["tid"], k)
                req = json.loads(body)
                turn_orphans += orphan_count(req["messages"])
                if prev is not None and k not in compacted:
                    ok = prefix_extends(prev, req)
                    eligible += 1
                    stable += ok
                    if k in resumed_before:
                        across += 1
                        across_stable += ok
                prev = req
            if turn_orphans:
                problems.append(f"{turn_orphans} orphaned tool calls/results in its served requests")
            request_orphans += turn_orphans
            report.append({"turn": t["label"], "steps": len(t["script"]), "kills": t["hits"],
                           "terminal": terminal_types(evs), "resumes": sum(e["type"] == "TurnResumed" for e in evs),
                           "problems": problems})
    finally:
        for r in runners:
            r.kill()
        edge.stop()
        await api.aclose()
    ok = [r for r in report if r["terminal"] == ["TurnCompleted"] and not r["problems"]]
    return {
        "kills": killed_mid_turn, "killAttempts": attempts, "runnersStarted": len(runners), "turns": len(report),
        "turnsHit": sum(1 for r in report if r["kills"]), "resumes": sum(r["resumes"] for r in report),
        "completedOnce": len(ok), "allCompletedOnce": len(ok) == len(report),
        "orphansInServedRequests": request_orphans,
        "prefix_stability": round(stable / eligible, 4) if eligible else None,
        "prefixStepsServedAfterAResume": across, "prefixStableAfterAResume": across_stable,
        "resumeAfterKill_s": {"median": round(statistics.median(resume_after_kill), 2),
                              "max": round(max(resume_after_kill), 2), "n": len(resume_after_kill)}
        if resume_after_kill else {"n": 0},
        "ackWait_s": float(KILL_ACK_WAIT), "wall_s": round(wall, 1), "perTurn": report,
    }


# ---------------------------------------------------------------- main

def environment(load_before: tuple[float, float, float], window: int) -> dict[str, Any]:
    budget = compaction_budget(window)
    return {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "platform": platform.platform(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "stack": "private: NATS JetStream (sync always), Postgres (fsync on), SeaweedFS S3, six services as "
                     "processes, loopback",
            "contextWindow": window, "compactionTrigger": budget.trigger, "compactionKeep": budget.keep,
            "inflightThreshold": inflight_threshold(None, window), "summarizer": "extractive (service default)",
            "loadavg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}


def overall(per: dict[str, dict[str, Any]]) -> dict[str, Any]:
    raw = [x for r in per.values() for x in r.pop("_raw")]
    served = [x for r in per.values() for x in r.pop("_served")]
    over = [x for r in per.values() for x in r.pop("_overheads")]
    eligible = sum(r["prefixEligibleSteps"] for r in per.values())
    stable = sum(r["prefixStableSteps"] for r in per.values())
    trimmed = sum(r["trimmedResults"] for r in per.values())
    recovered = sum(r["recoverable"] for r in per.values())
    web = [r["citations"] for r in per.values() if "citations" in r]
    items = sum(c[k]["items"] for c in web for k in ("servedRequests", "persistedMessages"))
    intact = sum(c[k]["intact"] for c in web for k in ("servedRequests", "persistedMessages"))
    broken_parts = sum(c[k]["partsBroken"] for c in web for k in ("servedRequests", "persistedMessages"))
    return {
        "steps": len(served), "rawHistoryTokensPerStep": mean_max(raw), "servedTokensPerStep": mean_max(served),
        "servedOverRawTotal": round(sum(served) / sum(raw), 4) if raw else None,
        "prefix_stability": round(stable / eligible, 4) if eligible else None, "prefixEligibleSteps": eligible,
        "orphans": sum(r["orphansInServedRequests"] + r["orphansInPersistedHistory"] for r in per.values()),
        "citationSkeletonsIntact": round(intact / items, 4) if items else None,
        "citationItemsChecked": items, "citationPartsBroken": broken_parts,
        "recoverable": round(recovered / trimmed, 4) if trimmed else None, "trimmedResults": trimmed,
        "pipelineOverhead": summary_ms(over),
        "failedTurns": sum(len(r["failedTurns"]) for r in per.values()),
    }


async def measure(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    items = [i for i in replay_set() if not args.only or i["label"] in args.only]
    total_steps = sum(len(t.script) for i in items for t in i["traj"].turns)
    api = Api(stack.env["CTX_ORCHESTRATION_HTTP"], stack.env["CTX_API_KEY"])
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    out: dict[str, Any] = {}
    try:
        with Progress(*cols) as progress:
            if "replay" in args.phases:
                t_replay = progress.add_task("replay (steps)", total=total_steps)
                per: dict[str, dict[str, Any]] = {}
                for item in items:
                    per[item["label"]] = await replay_conversation(api, item, args.window, progress, t_replay)
                out["overall"] = overall(per)
                out["trajectories"] = per
            if "throughput" in args.phases:
                t_tp = progress.add_task("throughput (batches)", total=args.sequential + args.batches)
                out["throughput"] = await throughput(api, load_trajectory(SWE), args.window, args.concurrency,
                                                     args.batches, args.sequential, progress, t_tp)
            if "scaling" in args.phases:
                t_sc = progress.add_task("replicas (batches)", total=args.scale_rounds * len(SCALE_CONFIGS))
                out["scaling"] = await scaling(stack, load_trajectory(SWE), args.window, args.scale_concurrency,
                                               args.scale_rounds, progress, t_sc)
            if "kill" in args.phases:
                t_kill = progress.add_task("kill test (mid-turn kills)", total=args.kills)
                out["killTest"] = await kill_test(stack, args.kills, args.window, args.seed, progress, t_kill)
    finally:
        await api.aclose()
    return out


def write(out: Path, result: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "e2e.json")
    ap.add_argument("--window", type=int, default=32_000, help="contextWindow of every conversation (tokens)")
    ap.add_argument("--concurrency", type=int, default=16, help="turns submitted at once for throughput")
    ap.add_argument("--batches", type=int, default=2, help="batches of --concurrency turns (wall times summed)")
    ap.add_argument("--sequential", type=int, default=4, help="turns run one at a time, for comparison")
    ap.add_argument("--kills", type=int, default=10, help="mid-turn SIGKILLs of the runner in the kill test")
    ap.add_argument("--seed", type=int, default=9)
    ap.add_argument("--scale-concurrency", type=int, default=16,
                    help="turns submitted at once per batch with 1/2 runner and 1/2 persistence replicas")
    ap.add_argument("--scale-rounds", type=int, default=2, help="visits of each replica configuration")
    ap.add_argument("--phases", nargs="+", default=["replay", "throughput", "scaling", "kill"],
                    choices=["replay", "throughput", "scaling", "kill"], help="run only these parts (development)")
    ap.add_argument("--only", nargs="*", help="replay only these trajectory labels (development)")
    args = ap.parse_args()
    head = {"benchmark": "e2e", "definitions": DEFINITIONS}
    if not all(p.is_file() for p in (SWE, MINI, TAU, STORM)):
        head["skipped"] = f"shared trajectories absent ({TRAJ})"
        head["environment"] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                               "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        write(args.out, head)
        print(json.dumps(head, indent=2))
        return
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    with private_stack("ctxbuild-bench-e2e-") as stack:
        result = asyncio.run(measure(stack, args))
    result = {**head, "headline": None, **result, "seconds": round(time.perf_counter() - t0, 1),
              "environment": environment(load_before, args.window)}
    o, tp, k = result.get("overall", {}), result.get("throughput", {}), result.get("killTest", {})
    result["headline"] = {
        "steps": o.get("steps"), "servedTokensMean": o.get("servedTokensPerStep", {}).get("mean"),
        "rawHistoryTokensMean": o.get("rawHistoryTokensPerStep", {}).get("mean"),
        "prefix_stability": o.get("prefix_stability"), "orphans": o.get("orphans"),
        "citationSkeletonsIntact": o.get("citationSkeletonsIntact"), "recoverable": o.get("recoverable"),
        "pipelineOverhead_median_ms": o.get("pipelineOverhead", {}).get("median_ms"),
        "pipelineOverhead_p99_ms": o.get("pipelineOverhead", {}).get("p99_ms"),
        "turns_per_s_16_concurrent": tp.get("concurrent", {}).get("turns_per_s"),
        "turns_per_s_one_at_a_time": tp.get("oneAtATime", {}).get("turns_per_s"),
        "kills": k.get("kills"), "killTestAllCompletedOnce": k.get("allCompletedOnce"),
        **{f"turns_per_s_{name}": c["turns_per_s"]
           for name, c in result.get("scaling", {}).get("configs", {}).items()},
    }
    write(args.out, result)
    print(json.dumps({"headline": result["headline"], "trajectories": {
        name: {key: r[key] for key in ("steps", "servedTokensPerStep", "rawHistoryTokensPerStep", "prefix_stability",
                                        "orphansInServedRequests", "recoverableShare", "pipelineOverhead")}
        for name, r in result.get("trajectories", {}).items()}}, indent=2))
    missed = []
    if o and (o["orphans"] != 0 or o["failedTurns"] != 0):
        missed.append("orphans 0 and every replayed turn completed")
    if o and (o["citationSkeletonsIntact"] not in (None, 1.0) or o["recoverable"] not in (None, 1.0)):
        missed.append("citations and recoverable 100%")
    if k and (not k["allCompletedOnce"] or k["kills"] != args.kills):
        missed.append(f"{args.kills} mid-turn kills with every turn completed once")
    if missed:
        sys.exit(f"e2e targets missed ({'; '.join(missed)}): see {args.out}")

if __name__ == "__main__":
    main()
