"""MCP tool catalogs saved as files: ``<server>.tools.json`` = ``{"server": …, "tools": [tools/list entries]}``
(the real catalogs under the shared data folder), read as the catalog's cached tools — what the benches and the
real-data tests rank, sanitize and defer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..domain.tools import cached_tool


def load_catalogs(folder: Path) -> dict[str, list[dict[str, Any]]]:
    """Each server's tools (its id is also its label and namespace), by server, in file-name order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for f in sorted(folder.glob("*.tools.json")):
        doc = json.loads(f.read_text())
        server = doc["server"]
        out[server] = [{**cached_tool(server, server, t["name"], t.get("description"), t["inputSchema"]),
                        "namespace": server} for t in doc["tools"]]
    return out
