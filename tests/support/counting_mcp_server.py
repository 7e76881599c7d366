"""A stdio MCP server that counts its tool runs, for the chaos suite: ``stamp(key)`` appends ``key`` to the
ledger file named on its command line (one line per run, flushed and fsynced before it answers), takes
``delay_ms`` (a tool that takes a while: the chaos suite's turns last long enough to be hit three times) and
answers ``stamped <key>``. A tool run the pipeline repeats after a fault shows up as a key written twice.

Run as ``python tests/support/counting_mcp_server.py <ledger>`` (the catalog starts it over stdio).
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from pathlib import Path

LEDGER = Path(sys.argv[1]) if __name__ == "__main__" and len(sys.argv) > 1 else None


def runs(ledger: Path) -> Counter[str]:
    """How many times each key was stamped."""
    if not ledger.exists():
        return Counter()
    return Counter(line for line in ledger.read_text().splitlines() if line)


if __name__ == "__main__":
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("chaosctr")

    @server.tool(description="Stamp a key in the ledger (a tool with a side effect: each run is counted).")
    def stamp(key: str, delay_ms: int = 0) -> str:
        assert LEDGER is not None
        time.sleep(min(delay_ms, 10_000) / 1000)
        with open(LEDGER, "a") as f:
            f.write(key.replace("\n", " ") + "\n")
            f.flush()
            os.fsync(f.fileno())
        return f"stamped {key}"

    server.run("stdio")
