"""Every service shares the platform runner: health endpoints, and SIGTERM drains in-flight work, then exits."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from ctxbuild_devstack import free_port
from ctxbuild_platform.errors import RemoteError

pytestmark = pytest.mark.integration


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else "exited"
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
