"""Blob store adapters against dead endpoints (a closed loopback port, no mocks): a store that is down must
become a retryable `unavailable` error within seconds, never a hang or an untyped crash."""

import socket
import time

import pytest
from ctxbuild_blobstore.adapters.migrate import yoyo_url
from ctxbuild_blobstore.adapters.postgres import Postgres
from ctxbuild_blobstore.adapters.s3 import ObjectStore, object_key
from ctxbuild_platform.errors import DependencyUnavailable


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on exit: connections are refused


async def test_dead_s3_is_unavailable_quickly():
    store = ObjectStore(f"http://127.0.0.1:{closed_port()}", "k", "s", "bucket", timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(DependencyUnavailable) as err:
        await store.ensure_object("a" * 64, b"hello")
    assert err.value.retryable and err.value.code == "unavailable"
    assert err.value.message.startswith("s3: ")
    assert time.monotonic() - t0 < 5


async def test_dead_postgres_is_unavailable_quickly():
    db = Postgres(f"postgresql://postgres@127.0.0.1:{closed_port()}/x", timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(DependencyUnavailable) as err:
        await db.connect()
    assert err.value.retryable and err.value.message.startswith("postgres: ")
    with pytest.raises(DependencyUnavailable):  # never connected: still typed
        await db.candidates("0" * 16, "c")
    assert time.monotonic() - t0 < 5


def test_yoyo_url_uses_psycopg3_and_the_service_schema():
    assert yoyo_url("postgresql://postgres@127.0.0.1:5432/ctxbuild") == \
        "postgresql+psycopg://postgres@127.0.0.1:5432/ctxbuild?schema=blobstore"
    assert yoyo_url("postgresql://u:p%40ss@h/db?sslmode=require") == \
        "postgresql+psycopg://u:p%40ss@h/db?sslmode=require&schema=blobstore"


def test_object_key():
    assert object_key("ab" * 32) == "blobs/" + "ab" * 32
