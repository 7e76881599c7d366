"""Every service shares the platform runner: health endpoints, and SIGTERM drains in-flight work, then exits."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from ctxbuild_devstack import free_port
from ctxbuild_platform.errors import RemoteError

pytestmark = pytest.mark.integration


class Output(threading.Thread):
    """A process's output, read as it comes (so a test can wait for a line while the process runs)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        super().__init__(daemon=True)
        self.proc, self.lines, self.ended = proc, [], False
        self.changed = threading.Condition()
        self.start()

    def run(self) -> None:
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line.decode(errors="replace"))
                self.changed.notify_all()
        with self.changed:
            self.ended = True
            self.changed.notify_all()

    def text(self) -> str:
        with self.changed:
            return "".join(self.lines)

    def wait_for(self, needle: str, timeout: float) -> bool:
        """Whether a line holding ``needle`` came before the output ended or ``timeout`` passed."""
        def seen() -> bool:
            return any(needle in line for line in self.lines)

        with self.changed:
            self.changed.wait_for(lambda: seen() or self.ended, timeout)
            return seen()


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 30, output: Output | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, (output.text() if output else
                                     proc.stdout.read().decode() if proc.stdout else "exited")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} not ready")


async def test_sigterm_drains_in_flight_requests_then_exits(stack, start_service, rpc):
    start_service("blobstore")
    stack.stop("truncation")  # our own instance must be the only one in the queue group
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ctxbuild_truncation"],
                            env={**os.environ, **stack.service_env("truncation"), "CTX_HTTP_PORT": str(port)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_ready(f"http://127.0.0.1:{port}/readyz", proc)
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").json() == {"status": "alive"}
        big = "\n".join(f"{i:07d} " + "x" * 80 for i in range(9_000))  # ~800 KB: trim + blob put take a while
        part = {"type": "tool-result", "toolCallId": "c1", "toolName": "read_file",
                "output": {"type": "text", "value": big}}
        request = asyncio.create_task(rpc.call("ctx.truncate.step", {
            "conversationId": "conv_lifecycle", "turnId": "turn_lifecycle", "settings": {"contextWindow": 16000},
            "parts": [part]}))
        await asyncio.sleep(0.02)  # the request is in flight
        proc.send_signal(signal.SIGTERM)
        reply = await request  # drained: answered, not dropped
        assert reply["parts"][0]["offload"]["mode"] == "offloaded"
        assert await asyncio.to_thread(proc.wait, 30) == 0
        with pytest.raises(RemoteError) as gone:
            await rpc.call("ctx.truncate.step", {"conversationId": "c", "turnId": "t", "settings": {},
                                                 "parts": [part]}, timeout=2)
        assert gone.value.retryable
    finally:
        if proc.poll() is None:
            proc.kill()
        start_service("truncation")


class LateProxy:
    """A TCP forwarder to a real server that starts listening only when asked (a dependency coming up late)."""

    def __init__(self, port: int, target: tuple[str, int]) -> None:
        self.port, self.target = port, target
        self.server: asyncio.base_events.Server | None = None
        self.conns: set[asyncio.StreamWriter] = set()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(*self.target)
        self.conns |= {writer, up_w}
        await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer))

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def stop(self) -> None:
        self.server.close()
        for w in self.conns:
            w.close()
        await self.server.wait_closed()


async def test_startup_waits_for_a_late_dependency_and_readiness_follows_it(stack):
    """A dependency that is not up yet is retried (not a crash); one lost later flips readiness, not liveness."""
    s3 = stack.env["CTX_S3_ENDPOINT"].removeprefix("http://").split(":")
    proxy = LateProxy(free_port(), (s3[0], int(s3[1])))
    port = free_port()
    env = {**os.environ, **stack.service_env("blobstore"), "CTX_HTTP_PORT": str(port),
           "CTX_S3_ENDPOINT": f"http://127.0.0.1:{proxy.port}", "CTX_S3_TIMEOUT_S": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "ctxbuild_blobstore"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = Output(proc)
    base = f"http://127.0.0.1:{port}"
    try:
        # S3 comes up only once start-up has met it down and said it retries (a fixed head start raced a slow
        # start-up: on a loaded machine the service reached S3 after the proxy was up, and had nothing to retry)
        assert await asyncio.to_thread(output.wait_for, "startup-retry", 60), output.text()
        assert proc.poll() is None, "start-up gave up instead of retrying"
        await proxy.start()
        await asyncio.to_thread(_wait_ready, f"{base}/readyz", proc, 60, output)
        await proxy.stop()
        async with httpx.AsyncClient(timeout=10) as http:
            for _ in range(50):
                if (await http.get(f"{base}/readyz")).status_code == 503:
                    break
                await asyncio.sleep(0.2)
            ready = await http.get(f"{base}/readyz")
            assert ready.status_code == 503 and "s3" in ready.json()["failing"]
            assert (await http.get(f"{base}/healthz")).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    output.join()
    assert output.text().count("startup-retry") >= 1
