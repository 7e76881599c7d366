"""The chaos suite's fixtures (issue #16): its own private stack (NATS, Postgres, SeaweedFS and the six services as
processes, in the run's temporary folder; it dies with the run), a counting MCP server registered in the catalog,
the replayed real turns (../shared/data/trajectories), their fault-free runs, and the record of every injection
that ``make test-chaos`` turns into bench/results/chaos.json (``CTX_CHAOS_OUT`` names the file this writes)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from ctxbuild_devstack import SERVICES, Stack
from ctxbuild_mcp_catalog.domain.tool_ids import tool_id
from ctxbuild_platform.rpc import RpcClient
from faststream.nats import NatsBroker

from tests.support.chaos import RECORD, STAMP_SERVER, Edge

COUNTER = Path(__file__).resolve().parents[1] / "support" / "counting_mcp_server.py"
# the runner's ack wait: a SIGKILLed runner's turn is redelivered after this (the default 30 s would only slow
# the suite down)
# the chaos tools answer in milliseconds: a call lost with a killed catalog times out after 15 s, not the default 60
SERVICE_ENV = {"orchestration": {"CTX_TURN_ACK_WAIT_S": "3", "CTX_TOOL_TIMEOUT_S": "15"}}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "chaos: a fault injected into a real stack (make test-chaos)")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "tests/chaos/" not in report.nodeid.replace("\\", "/"):
        return
    if report.when == "call" or report.outcome != "passed":
        prev = RECORD["tests"].get(report.nodeid)
        if prev in ("failed", "error"):
            return
        RECORD["tests"][report.nodeid] = ("error" if report.when != "call" and report.outcome == "failed"
                                          else report.outcome)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = os.environ.get("CTX_CHAOS_OUT")
    if not out:
        return
    if not RECORD["started"]:
        from tests.conftest import SHARED_DATA

        RECORD["skipped"] = ("shared data absent" if not SHARED_DATA.is_dir() else
                             "the chaos stack never started (see the test errors)")
    else:
        RECORD["seconds"] = round(time.monotonic() - RECORD.pop("_t0"), 1)
    RECORD["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(RECORD, indent=2) + "\n")


@pytest.fixture(scope="session")
def chaos_record() -> dict[str, Any]:
    return RECORD


@pytest.fixture(scope="session")
def chaos_stack(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> Stack:
    RECORD["started"] = datetime.now(UTC).isoformat(timespec="seconds")
    RECORD["_t0"] = time.monotonic()
    st = Stack(root=tmp_path_factory.mktemp("chaos-stack"), fast_fsync=True, owner_pid=os.getpid())
    try:
        st.start_infra()
        for name in SERVICES:
            st.start_service(name, extra_env=SERVICE_ENV.get(name, {}), timeout=120)
        yield st
    finally:
        st.down()


@pytest.fixture(scope="session")
def ledger(chaos_stack: Stack) -> Path:
    """The counting MCP server's ledger: one line per real run of ``stamp``."""
    path = chaos_stack.root / "stamp-ledger.txt"

    async def register() -> None:
        broker = NatsBroker(chaos_stack.env["CTX_NATS_URL"], logger=None)
        await broker.connect()
        try:
            await RpcClient(broker, default_timeout=60).call("ctx.mcp.servers.upsert", {"server": {
                "id": STAMP_SERVER, "name": STAMP_SERVER, "transport": "stdio", "command": sys.executable,
                "args": [str(COUNTER), str(path)]}})
        finally:
            await broker.stop()

    asyncio.run(register())
    return path


@pytest.fixture(scope="session")
def stamp_tool() -> str:
    return tool_id(STAMP_SERVER, "stamp", STAMP_SERVER)


@pytest.fixture(scope="session")
def edge(chaos_stack: Stack) -> Edge:
    return Edge(lambda: chaos_stack.env["CTX_ORCHESTRATION_HTTP"], chaos_stack.api_headers())
