"""A uvicorn server in a background thread on a loopback port: the base of the local wire-format servers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any, TypeVar

import uvicorn


class ThreadedServer:
    def __init__(self, app: Any, port: int) -> None:
        self.port = port
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self):
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.server.started:
            raise RuntimeError(f"local server on port {self.port} did not start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)


S = TypeVar("S", bound=ThreadedServer)


def serving(server: S) -> Iterator[S]:
    """A fixture's body for a local server (``yield from serving(FakeOpenAI(free_port()))``): started for the
    fixture's scope, stopped after it."""
    yield server.start()
    server.stop()
