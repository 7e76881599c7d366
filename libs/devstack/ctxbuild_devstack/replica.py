"""An extra service process started by a test or a benchmark (the stack's env plus overrides, its own HTTP port and
log), to run several replicas of one service, kill one, or start one with other settings."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ctxbuild_devstack.stack import free_port


class Replica:
    def __init__(self, stack, service: str, name: str, **env: str) -> None:
        self.name = name
        self.port = free_port()
        self.log = Path(stack.logs) / f"{name}.log"
        full_env = {**os.environ, **stack.service_env(service), "CTX_HTTP_PORT": str(self.port), **env}
        fh = open(self.log, "ab")  # noqa: SIM115 — the child keeps the descriptor
        self.proc = subprocess.Popen([sys.executable, "-m", f"ctxbuild_{service}"], env=full_env, stdout=fh,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        fh.close()
        self.url = f"http://127.0.0.1:{self.port}"
        self._stack = stack
        if hasattr(stack, "adopt"):
            stack.adopt(name, self.proc.pid)  # dies with the stack's owner (tests, benchmarks) too

    def wait_ready(self, timeout: float = 60) -> Replica:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready: {self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye — what a crashed node looks like."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._disown()

    def _disown(self) -> None:
        if hasattr(self._stack, "disown"):
            self._stack.disown(self.name)

    def stop(self, timeout: float = 30) -> int | None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._disown()
        return self.proc.returncode
