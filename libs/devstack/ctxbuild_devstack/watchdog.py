"""A test or benchmark stack dies with the process that started it.

``python -m ctxbuild_devstack.watchdog --owner PID --owner-start TICKS --state <dir>/state.json`` runs in its own
session beside the stack (``Stack(owner_pid=…)`` starts it with the first component). It polls the owner; once the
owner is gone — however it ended: a pytest run killed with SIGKILL, a Ctrl-C'd benchmark — it SIGKILLs the process
group of every component recorded in the state file (NATS, Postgres and its backends, SeaweedFS, the services) and
of every adopted replica, then exits. ``Stack.down`` stops it first (SIGTERM), so an orderly end is unchanged.

Why a watchdog and not PR_SET_PDEATHSIG: the parent-death signal fires when the *thread* that forked the child
exits, and stacks are started and restarted from worker threads (asyncio.to_thread) too; a watchdog keyed on the
owner's pid and start time (a recycled pid is not the owner) is exact, and works for Postgres running as another
user as well (the watchdog runs as whoever started the stack, root included).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

from .stack import proc_start_time

POLL_S = 0.5


def owner_alive(pid: int, start: str | None) -> bool:
    now = proc_start_time(pid)
    if now is None:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(") ", 1)[1].startswith("Z"):
                return False  # exited, not yet reaped
    except OSError:
        return False
    return not start or now == start


def pids(state: Path) -> list[int]:
    for _ in range(20):
        try:
            data = json.loads(state.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError):
            time.sleep(0.05)  # written aside and renamed, so this is rare
            continue
        return [int(p["pid"]) for p in (data.get("procs") or {}).values()] + \
            [int(pid) for pid in (data.get("adopted") or {}).values()]
    return []


def kill_all(state: Path) -> None:
    for pid in pids(state):
        for kill in (os.killpg, os.kill):  # components lead their own process group
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--owner", type=int, required=True)
    parser.add_argument("--owner-start", default="")
    parser.add_argument("--state", type=Path, required=True)
    args = parser.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the terminal's group is the owner's to handle
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # Stack.down: the owner stopped the stack itself
    while owner_alive(args.owner, args.owner_start or None):
        time.sleep(POLL_S)
    kill_all(args.state)
    print(f"owner {args.owner} gone: killed the stack's processes ({args.state})", flush=True)


if __name__ == "__main__":
    main()
