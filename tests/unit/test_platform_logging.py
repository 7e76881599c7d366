"""Service logs (``ctxbuild_platform.logging``): one JSON object per line, each line one write (a reader tailing the
file never sees half a line), and the HTTP clients' per-request lines only when debugging."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import json, logging, sys

    class Writes:
        def __init__(self): self.calls = []
        def write(self, s): self.calls.append(s); return len(s)
        def flush(self): pass

    rec = Writes()
    sys.stderr = rec
    from ctxbuild_platform.logging import configure_logging
    log = configure_logging("probe", sys.argv[1])
    log.info("turn-ended", turn_id="t1")
    logging.getLogger("httpx2").info("HTTP Request: POST http://upstream/v1/chat/completions")
    logging.getLogger("httpx").info("HTTP Request: GET http://mcp/")
    logging.getLogger("httpx2").warning("retrying")
    sys.__stdout__.write(json.dumps(rec.calls))
""")


def written(level: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PROBE, level], capture_output=True, text=True, timeout=60,
                          check=True)
    return json.loads(done.stdout)


def test_each_line_is_one_write_and_the_http_clients_lines_wait_for_debug():
    calls = written("INFO")
    ours = [json.loads(c) for c in calls if "turn-ended" in c]
    assert len(ours) == 1 and ours[0]["turn_id"] == "t1" and ours[0]["service"] == "probe"
    assert all(c.endswith("\n") and c.count("\n") == 1 for c in calls), calls  # whole lines, one per write
    assert not any("HTTP Request" in c for c in calls)
    assert any("retrying" in c for c in calls)  # the clients' warnings still show


def test_at_debug_the_http_clients_lines_show():
    calls = written("DEBUG")
    assert sum("HTTP Request" in c for c in calls) == 2
