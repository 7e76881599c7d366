"""Chaos (issue #16, SPEC §15.4): for each fault — SIGKILL of truncation, persistence, blobstore, compaction,
mcp_catalog and the runner; a NATS crash and restart; Postgres and SeaweedFS stop/start; poison messages on the
turn queue — three injections at random points (seeded: ``CTX_CHAOS_SEED``) of a real replayed turn
(../shared/data/trajectories, a 16k window so truncation and compaction act, a real counted MCP tool spliced in),
each component back on its own port after a random outage. Then a short follow-up turn in the same conversation.

After each fault the checker (tests/support/chaos.py) compares both turns with a fault-free run of the same
scripts: exactly one terminal event (TurnCompleted), none left non-terminal, no lost or duplicated event, no tool
run repeated, no orphan tool call and no request over the window in anything served. Every injection and verdict
goes to the run's record (bench/results/chaos.json through ``make test-chaos``). Nothing is mocked.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import nats
import pytest
from ctxbuild_cli.client import Client
from ctxbuild_devstack import SERVICES, Stack
from ctxbuild_providers.trajectories import load_trajectory

from bench.e2e_metrics import history_problems
from tests.support.chaos import SEED, STAMP_SERVER, WINDOW, Edge, Verdict, check_turn, with_stamps
from tests.support.counting_mcp_server import runs

pytestmark = [pytest.mark.chaos, pytest.mark.shared_data, pytest.mark.timeout(900)]

SERVICE_FAULTS = {"truncation": "truncation", "persistence": "persistence", "blobstore": "blobstore",
                  "compaction": "compaction", "mcp_catalog": "mcp_catalog", "runner": "orchestration"}
FAULTS = [*SERVICE_FAULTS, "nats", "postgres", "s3", "poison"]
# the faulted turn's stamp calls take this long in all (its recorded tools take no time): long enough for three
# faults and their restarts to land while it runs — a service restart waits for readiness, and on a loaded 2-core
# machine a compaction restart outlasted the 7 steps (of 0.76 s each at 16 s) left before the third point: that
# fault landed after its turn had ended (29 of 30); the fault-free run takes no delay (inputs are not compared)
TURN_MS = 24_000
TURN_PATIENCE_S = 240.0  # after the last fault is over: a turn with no terminal event by then is stuck
POISON = {  # what no consumer can process, published on the turn queue (JetStream) like a real command
    "deep-array": b"[" * 200_000 + b"]" * 200_000,
    "lone-surrogate": b'{"turnId": "turn_\\ud800", "conversationId": "conv_\\udfff"}',
    "not-json": b"\xff\xfe\x00 this is not JSON {",
}


def trajectories(shared: Path) -> list[dict[str, Any]]:
    """Three real runs of a few dozen model calls each (the recorded tool outputs replayed)."""
    t = shared / "trajectories"
    swe = load_trajectory(t / "01_sweagent_marshmallow-1867_function_calling.traj")
    mini = load_trajectory(t / "03_miniswe_deepseek-chat_sqlfluff-1733.traj.json")
    tau = load_trajectory(t / "05_taubench_gpt-4o-airline_subset.json", 2)
    mini_script = [*mini.turns[0].script[:21], {"text": "stopping after twenty commands"}]
    return [
        {"label": "mini-swe-agent[:22]", "text": mini.turns[0].text, "script": mini_script, "tools": mini.tools},
        {"label": "swe-agent", "text": swe.turns[0].text, "script": swe.turns[0].script, "tools": swe.tools},
        {"label": "tau-bench#2 turn 3", "text": tau.turns[3].text, "script": tau.turns[3].script, "tools": tau.tools},
    ]


def follow_up(stamp_tool: str, nonce: str) -> list[dict[str, Any]]:
    return [{"toolCalls": [{"toolName": stamp_tool, "input": {"key": f"{nonce}/follow-up"}}]},
            {"text": "the ledger is stamped"}]


def provider(script: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"kind": "replay", "script": script, **({"tools": tools} if tools else {})}


def ledger_runs(ledger: Path, nonce: str) -> Counter[str]:
    return Counter({k: n for k, n in runs(ledger).items() if k.startswith(nonce + "/")})


class Conversation:
    """One conversation: the replayed turn (faults injected into it) then the follow-up turn."""

    def __init__(self, edge: Edge, item: dict[str, Any], stamp_tool: str, title: str, slow: bool) -> None:
        self.edge, self.item = edge, item
        self.nonce = f"{title}-{uuid.uuid4().hex[:8]}".replace(" ", "-")
        tool_steps = sum(1 for s in item["script"] if s.get("toolCalls"))
        delay = int(TURN_MS / tool_steps) if slow else 0
        self.script = with_stamps(item["script"], stamp_tool, self.nonce, delay)
        self.follow = follow_up(stamp_tool, self.nonce)
        self.cid = edge.conversation(title, {"contextWindow": WINDOW, "mcpServers": [STAMP_SERVER]})
        self.turns: list[tuple[str, str]] = []  # (label, turn id)

    def start(self) -> str:
        tid = self.edge.start_turn(self.cid, self.item["text"], provider(self.script, self.item["tools"]),
                                   len(self.script))
        self.turns.append((self.item["label"], tid))
        return tid

    def start_follow_up(self) -> str:
        tid = self.edge.start_turn(self.cid, "stamp the ledger once more", provider(self.follow), len(self.follow))
        self.turns.append(("follow-up", tid))
        return tid


class Follower(threading.Thread):
    """`ctxbuild watch` through the faults: the CLI's own client follows the turn's events (SSE, Last-Event-ID,
    the turn log when the stream drops) from start to end while components die under it."""

    def __init__(self, stack: Stack, cid: str, tid: str) -> None:
        super().__init__(daemon=True, name=f"follow-{tid}")
        self.client = Client(stack.env["CTX_ORCHESTRATION_HTTP"], api_key=stack.env["CTX_API_KEY"])
        self.cid, self.tid = cid, tid
        self.seen: list[tuple[str, int]] = []
        self.error: str | None = None

    def run(self) -> None:
        try:
            for ev in self.client.events(self.cid, self.tid):
                self.seen.append((ev.type, ev.id))
        except Exception as exc:  # noqa: BLE001 - reported by check()
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.client.close()

    def check(self, events: list[dict[str, Any]] | None, symptoms: list[str], label: str) -> int:
        """1 when the follower did not end on the turn's terminal event with every event once, in order."""
        self.join(60)
        if events is None:
            return 0  # the turn is stuck: counted there
        want = [(e["type"], e["version"]) for e in events]
        if self.is_alive() or self.error or self.seen != want:
            differ = next((i for i, (a, b) in enumerate(zip(self.seen, want, strict=False)) if a != b), None)
            symptoms.append(f"{label}: the CLI's follow {'still running' if self.is_alive() else 'ended'} "
                            f"with {len(self.seen)}/{len(want)} events, last {self.seen[-1:] or None}"
                            + (f"; first difference at #{differ}: followed {self.seen[max(0, differ - 2):differ + 3]}"
                               f", stored {want[max(0, differ - 2):differ + 3]}" if differ is not None else "")
                            + f"{'; ' + self.error[:200] if self.error else ''}")
            return 1
        return 0


def check_history(edge: Edge, c: Conversation, verdict: Verdict, label: str) -> None:
    """The conversation as persisted: each message once, each turn's assistant and tool messages as its script
    has model calls and tool steps, no orphan tool call or result (``bench.e2e_metrics.history_problems``)."""
    messages = edge.call("GET", f"/v1/conversations/{c.cid}/messages").json()["messages"]
    for (name, tid), script in zip(c.turns, (c.script, c.follow), strict=False):
        problems = history_problems(messages, tid, script)
        if problems:
            verdict.lost += 1
            verdict.symptoms.append(f"{label}/{name}: persisted history: {'; '.join(problems)[:300]}")


def run_fault_free(edge: Edge, item: dict[str, Any], stamp_tool: str) -> dict[str, Any]:
    c = Conversation(edge, item, stamp_tool, f"fault-free {item['label']}", slow=False)
    logs = []
    for start in (c.start, c.start_follow_up):
        tid = start()
        log = edge.wait_terminal(c.cid, tid, TURN_PATIENCE_S)
        assert log is not None, f"fault-free {item['label']}: turn {tid} never ended"
        logs.append(log)
    return {"conversation": c, "logs": logs}


@pytest.fixture(scope="session")
def baselines(chaos_stack, edge, ledger, stamp_tool, shared_data, chaos_record) -> dict[str, dict[str, Any]]:
    """The fault-free run of each script (main turn + follow-up), checked by the same checker."""
    out: dict[str, dict[str, Any]] = {}
    verdict, t0 = Verdict(), time.monotonic()
    for item in trajectories(shared_data):
        ref = run_fault_free(edge, item, stamp_tool)
        c = ref["conversation"]
        for k, log in enumerate(ref["logs"]):
            mine = Counter({key: v for key, v in ledger_runs(ledger, c.nonce).items()
                            if key.endswith("/follow-up") == (k == 1)})
            v = check_turn(log["events"], log["events"], edge.requests(c.cid, log["events"]), WINDOW, mine,
                           f"fault-free {item['label']}", log.get("error"))
            verdict.add(v)
        check_history(edge, c, verdict, f"fault-free {item['label']}")
        out[item["label"]] = {"item": item, "main": ref["logs"][0]["events"], "follow": ref["logs"][1]["events"]}
    chaos_record["baseline"] = {"turns": 2 * len(out), "steps": verdict.steps, "orphans": verdict.orphans,
                                "history_problems": verdict.lost,
                                "over_window": verdict.over_window, "bad_terminal": verdict.bad_terminal,
                    "cli_follow_failures": verdict.follow_failures,
                                "symptoms": verdict.symptoms, "seconds": round(time.monotonic() - t0, 1)}
    return out


def test_the_fault_free_runs_are_whole(baselines, chaos_record):
    """The reference itself passes the checks that need no reference: one TurnCompleted, nothing orphaned, nothing
    over the window."""
    b = chaos_record["baseline"]
    assert not (b["orphans"] or b["over_window"] or b["bad_terminal"] or b["history_problems"]), b["symptoms"]


# ---------------------------------------------------------------- the faults

def restore_readiness(stack: Stack, notes: list[str]) -> None:
    """Every service ready again after an infrastructure fault; one that is not within 60 s is restarted (what
    `make up` does) and noted."""
    for name in SERVICES:
        if not stack.wait_ready(name, 60):
            notes.append(f"{name} not ready 60 s after the fault: restarted")
            stack.stop(name, sig=signal.SIGKILL, timeout=5)
            stack.start_service(name, timeout=120)


def devstack(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ctxbuild_devstack", *args], capture_output=True, text=True,
                          timeout=300, check=False)


def publish_poison(stack: Stack, payload: bytes) -> int:
    async def go() -> int:
        nc = await nats.connect(stack.env["CTX_NATS_URL"], name="chaos-poison")
        try:
            ack = await nc.jetstream().publish("ctx.turn.run", payload,
                                               headers={"Nats-Msg-Id": f"poison-{uuid.uuid4().hex}"})
            return ack.seq
        finally:
            await nc.close()

    return asyncio.run(go())


def inject(stack: Stack, fault: str, outage_s: float, poison: str | None) -> list[str]:
    notes: list[str] = []
    if fault in SERVICE_FAULTS:
        name = SERVICE_FAULTS[fault]
        stack.stop(name, sig=signal.SIGKILL, timeout=5)
        time.sleep(outage_s)
        stack.start_service(name, timeout=120)
    elif fault == "nats":
        stack.stop("nats", sig=signal.SIGKILL, timeout=5)
        time.sleep(outage_s)
        stack.start_nats()
        restore_readiness(stack, notes)
        # `make status` sees the same: all nine ready again, exit 0
        status = subprocess.run([sys.executable, "-m", "ctxbuild_devstack", "status", "--dir", str(stack.root)],
                                capture_output=True, text=True, timeout=120, check=False)
        if status.returncode != 0:
            notes.append(f"STATUS: make status exits {status.returncode} with every service ready: "
                         f"{status.stdout[-600:]}")
    elif fault == "postgres":
        stack.stop("postgres")  # fast shutdown: clients are cut off
        time.sleep(outage_s)
        stack.start_postgres()
        restore_readiness(stack, notes)
    elif fault == "s3":
        stack.stop("s3")
        time.sleep(outage_s)
        stack.start_s3()
        restore_readiness(stack, notes)
    elif fault == "poison":
        seq = publish_poison(stack, POISON[poison])
        notes.append(f"{poison} ({len(POISON[poison])} bytes) at stream sequence {seq}")
    return notes


def poison_checks(stack: Stack, symptoms: list[str]) -> dict[str, Any]:
    """After the poison: nothing left pending or redelivered on the turn queue, the bad messages parked on the
    dead-letter stream (its subject ``ctx.dlq.<subject>``, the body as published), the runner ready."""

    async def go() -> dict[str, Any]:
        nc = await nats.connect(stack.env["CTX_NATS_URL"], name="chaos-poison-check")
        js = nc.jetstream()
        try:
            deadline = time.monotonic() + 120
            while True:
                ci = await js.consumer_info("CTX_TURNS", "turn-runner")
                si = await js.stream_info("CTX_TURNS")
                if (ci.num_pending == 0 and ci.num_ack_pending == 0 and si.state.messages == 0) or \
                        time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            out = {"pending": ci.num_pending, "ackPending": ci.num_ack_pending, "redelivered": ci.num_redelivered,
                   "queued": si.state.messages}
            if ci.num_ack_pending or ci.num_pending or si.state.messages:
                symptoms.append(f"poison: the turn queue still holds messages 120 s later ({out})")
            parked: list[bytes] = []
            try:
                dl = await js.stream_info("CTX_DEAD_LETTERS")
                for seq in range(dl.state.first_seq, dl.state.last_seq + 1):
                    try:
                        m = await js.get_msg("CTX_DEAD_LETTERS", seq)
                    except nats.js.errors.NotFoundError:
                        continue
                    if m.subject == "ctx.dlq.ctx.turn.run":
                        parked.append(m.data or b"")
            except nats.js.errors.NotFoundError:
                symptoms.append("poison: no dead-letter stream CTX_DEAD_LETTERS")
            missing = [k for k, body in POISON.items() if body not in parked]
            # a body too large for one message with the headers is parked as a claim: count it by its size header
            out["parked"] = len(parked)
            if missing:
                symptoms.append(f"poison: not parked on the dead-letter stream: {missing}")
            out["notParked"] = missing
            return out
        finally:
            await nc.close()

    out = asyncio.run(go())
    if not stack.wait_ready("orchestration", 30):
        symptoms.append("poison: the runner is not ready after the poison messages")
    return out


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_keeps_every_turn_whole(fault, chaos_stack, edge, ledger, stamp_tool, baselines, chaos_record):
    rng = random.Random(f"{SEED}/{fault}")
    label = list(baselines)[FAULTS.index(fault) % len(baselines)]
    ref = baselines[label]
    row: dict[str, Any] = {"fault": fault, "trajectory": label, "injections": [], "turns": 0,
                           "startedAt": time.strftime("%H:%M:%S", time.gmtime())}
    verdict = Verdict()
    t0 = time.monotonic()
    try:
        c = Conversation(edge, ref["item"], stamp_tool, f"chaos {fault}", slow=True)
        n = len(c.script)
        # three random points, one in each third of the turn (0: at once, before its first step); the last leaves a
        # few steps after it, so the fault still lands mid-turn when the remaining steps run fast
        thirds = [(0, n // 3), (n // 3 + 1, 2 * n // 3), (2 * n // 3 + 1, n - 4)]
        points = [rng.randint(lo, max(lo, hi)) for lo, hi in thirds]
        poisons = list(POISON)
        tid = c.start()
        follower = Follower(chaos_stack, c.cid, tid)
        follower.start()
        for i, p in enumerate(points):
            running = edge.wait_steps(c.cid, tid, p, timeout=TURN_PATIENCE_S)
            time.sleep(rng.uniform(0.0, 0.3))
            outage = round(rng.uniform(0.5, 2.5), 2)
            notes = inject(chaos_stack, fault, outage, poisons[i] if fault == "poison" else None)
            row["injections"].append({"afterStep": p, "midTurn": running,
                                      "outage_s": outage if fault != "poison" else 0, "notes": notes})
            verdict.symptoms.extend(f"{fault} injection {i + 1}: {x}" for x in notes)
        if fault == "poison":
            row["poison"] = poison_checks(chaos_stack, verdict.symptoms)
        logs = [edge.wait_terminal(c.cid, tid, TURN_PATIENCE_S)]
        verdict.follow_failures += follower.check(logs[0]["events"] if logs[0] else None, verdict.symptoms,
                                                  f"{fault}/{c.item['label']}")
        if logs[0] is not None:  # a stuck turn holds the conversation's lock: no follow-up then
            c.start_follow_up()
            logs.append(edge.wait_terminal(c.cid, c.turns[-1][1], TURN_PATIENCE_S))
        row["turns"] = len(logs)
        for (name, _), log, base in zip(c.turns, logs, (ref["main"], ref["follow"]), strict=False):
            requests = edge.requests(c.cid, log["events"]) if log else {}
            mine = Counter({k: v for k, v in ledger_runs(ledger, c.nonce).items()
                            if k.endswith("/follow-up") == (name == "follow-up")})
            verdict.add(check_turn(base, log["events"] if log else None, requests, WINDOW, mine,
                                   f"{fault}/{name}", (log or {}).get("error")))
        if all(logs):
            check_history(edge, c, verdict, fault)
    except Exception as exc:  # recorded, then re-raised below
        verdict.symptoms.append(f"{fault}: harness stopped: {type(exc).__name__}: {str(exc)[:400]}")
        if row["turns"] == 0:
            verdict.stuck += 1
        raise
    finally:
        row.update({"stuck": verdict.stuck, "lost": verdict.lost, "duplicates": verdict.duplicates,
                    "duplicate_tool_runs": verdict.duplicate_tool_runs, "orphans": verdict.orphans,
                    "over_window": verdict.over_window, "bad_terminal": verdict.bad_terminal,
                    "cli_follow_failures": verdict.follow_failures,
                    "steps_checked": verdict.steps, "degraded_results": verdict.degraded_results,
                    "longest_pause_s": verdict.longest_pause_s, "symptoms": verdict.symptoms,
                    "seconds": round(time.monotonic() - t0, 1)})
        row["passed"] = verdict.ok and not any(s.startswith("poison:") or "STATUS:" in s for s in verdict.symptoms)
        chaos_record["faults"].append(row)
    assert verdict.ok, "\n".join(verdict.symptoms)
    assert not [s for s in verdict.symptoms if "STATUS:" in s], verdict.symptoms
    if fault == "poison":
        assert not [s for s in verdict.symptoms if s.startswith("poison:")], verdict.symptoms


def test_make_up_restarts_a_hung_service_on_its_own_port(chaos_stack):
    """`make up` on a stack with a live service that does not answer its readiness probe (frozen with SIGSTOP):
    it restarts it at the same address, says "stack up", and `make status` exits 0 again."""
    name = "compaction"
    url, pid = chaos_stack.env["CTX_COMPACTION_HTTP"], chaos_stack.procs[name]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        assert not chaos_stack.ready(name)
        status = devstack("status", "--dir", str(chaos_stack.root))
        assert status.returncode == 1, status.stdout
        up = devstack("up", "--ready-wait", "5", "--dir", str(chaos_stack.root))
    finally:
        after = Stack.load(chaos_stack.root)  # the processes `up` started are ours (and their addresses)
        chaos_stack.procs.update(after.procs)
        chaos_stack.env.update(after.env)
        chaos_stack.save()
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert up.returncode == 0 and "stack up" in up.stdout and "restarting" in up.stdout, up.stdout + up.stderr
    assert chaos_stack.env["CTX_COMPACTION_HTTP"] == url and chaos_stack.procs[name]["pid"] != pid
    assert chaos_stack.wait_ready(name, 30), chaos_stack.status()
    assert devstack("status", "--dir", str(chaos_stack.root)).returncode == 0
