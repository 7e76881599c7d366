"""A bench's floor responder in a process of its own (the service it is compared with is one too): the bench
script re-run with ``--floor-responder``, on the stack's environment, ready once it prints ``ready``."""

from __future__ import annotations

import os
import subprocess
import sys

from ctxbuild_devstack import Stack


def start_floor_responder(script: str, stack: Stack, what: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, script, "--floor-responder"], env={**os.environ, **stack.env},
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != b"ready":
        proc.kill()
        raise RuntimeError(f"{what} did not start")
    return proc
