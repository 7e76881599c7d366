"""The local stack's own lifecycle (issue #16 point 6) with real processes: a test/bench stack dies with the process
that started it (SIGKILL included); a dead component comes back on its own port (``up`` again), and ``status``
exits non-zero while anything is not ready. (`up` restarting a hung service runs on the chaos suite's full
stack: tests/chaos/test_chaos_faults.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ctxbuild_devstack import Stack

pytestmark = pytest.mark.integration

OWNER = """
import os, sys, time
from pathlib import Path
from ctxbuild_devstack import Stack
st = Stack(root=Path(sys.argv[1]), owner_pid=os.getpid())
st.start_nats()
print(json.dumps({"nats": st.procs["nats"]["pid"], "watchdog": st.watchdog_pid}), flush=True)
time.sleep(600)
"""


def devstack(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ctxbuild_devstack", *args], check=False, capture_output=True,
                          text=True, timeout=180)


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].startswith("Z")
    except OSError:
        return True


def test_a_test_stack_dies_with_its_owner_even_on_sigkill(tmp_path: Path):
    owner = subprocess.Popen([sys.executable, "-c", "import json\n" + OWNER, str(tmp_path)], stdout=subprocess.PIPE,
                             text=True)
    try:
        pids = json.loads(owner.stdout.readline())
        assert not gone(pids["nats"]) and not gone(pids["watchdog"])
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (gone(pids["nats"]) and gone(pids["watchdog"])):
            time.sleep(0.1)
        assert gone(pids["nats"]), "nats-server outlived the process that started its stack"
        assert gone(pids["watchdog"])
    finally:
        if owner.poll() is None:
            owner.kill()
        Stack.load(tmp_path).down()


def test_a_dead_component_restarts_on_its_own_port_and_status_says_not_ready(tmp_path: Path):
    st = Stack(root=tmp_path, owner_pid=os.getpid())
    try:
        st.start_nats()
        url = st.env["CTX_NATS_URL"]
        # only NATS of nine components runs: not ready
        r = devstack("status", "--dir", str(tmp_path))
        assert r.returncode == 1, r.stdout
        os.killpg(st.procs["nats"]["pid"], signal.SIGKILL)  # a crash
        while not gone(st.procs["nats"]["pid"]):
            try:
                os.waitpid(st.procs["nats"]["pid"], os.WNOHANG)
            except ChildProcessError:
                break
            time.sleep(0.05)
        r = devstack("up", "--infra-only", "--dir", str(tmp_path))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "stack up" in r.stdout
        back = Stack.load(tmp_path)
        assert back.env["CTX_NATS_URL"] == url  # its own port: every client's URL still holds
        assert back.alive("nats") and back.procs["nats"]["pid"] != st.procs["nats"]["pid"]
        st.procs.update(back.procs)  # the new processes are ours to stop
    finally:
        st.procs.update(Stack.load(tmp_path).procs)
        st.down()

