"""The local stack itself: each server is real and reachable over its real protocol."""

import asyncpg
import pytest
from minio import Minio

pytestmark = pytest.mark.integration


async def test_postgres_accepts_sql(stack):
    conn = await asyncpg.connect(stack.env["CTX_DATABASE_URL"])
    try:
        assert await conn.fetchval("select 40 + 2") == 42
    finally:
        await conn.close()


async def test_jetstream_persists_a_message(nats_broker):
    js = nats_broker._connection.jetstream()
    await js.add_stream(name="STACKPROBE", subjects=["stackprobe.>"])
    ack = await js.publish("stackprobe.one", b"hello", headers={"Nats-Msg-Id": "probe-1"})
    dup = await js.publish("stackprobe.one", b"hello", headers={"Nats-Msg-Id": "probe-1"})
    assert ack.seq == 1 and dup.duplicate is True
    msg = await js.get_msg("STACKPROBE", 1)
    assert msg.data == b"hello"


def test_s3_round_trip(stack):
    endpoint = stack.env["CTX_S3_ENDPOINT"].removeprefix("http://")
    c = Minio(endpoint, access_key=stack.env["CTX_S3_ACCESS_KEY"], secret_key=stack.env["CTX_S3_SECRET_KEY"],
              secure=False)
    import io

    c.put_object(stack.env["CTX_S3_BUCKET"], "probe/x", io.BytesIO(b"bytes"), 5)
    assert c.get_object(stack.env["CTX_S3_BUCKET"], "probe/x").read() == b"bytes"
