"""What the outbox relay publishes to JetStream is what the event store holds: the body's ``data`` and
``metadata`` are the stored JSON text byte for byte (the relay never decodes and re-encodes them), and the stored
text is the compact JSON of what the caller sent, in its key order."""

from __future__ import annotations

import json
import uuid

import pytest

from tests.support.persistence import append, event, new_id

pytestmark = pytest.mark.integration

TRICKY = [
    {"z": 1, "a": "é ☃ 😀", "nul": "a\x00b", "ls": "\u2028", "ctl": "\t\n", "quote": "\"\\/"},
    {"f": 0.1, "big": 12345678901234567890, "e": 1e300, "neg": -0.0, "t": True, "n": None},
    {"nested": {"b": [1, {"c": None}, []], "a": {}}, "日本": ["語", {"ключ": "значение"}]},
    {},
]


@pytest.fixture(scope="module")
def persistence(start_service) -> str:
    return start_service("persistence")


def compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


async def test_the_published_body_holds_the_stored_text_byte_for_byte(persistence, rpc, nats_broker, pg):
    type_ = f"Published{uuid.uuid4().hex[:10]}"  # no contract: any data is taken
    stream = f"test:{new_id()}"
    sent = [event(type_, data, metadata={"zeta": "ü", "alpha": [1, 2]}) for data in TRICKY]
    res = await append(rpc, stream, sent, expected=0)
    assert res["duplicates"] == 0

    js = nats_broker.connection.jetstream()
    sub = await js.subscribe(f"ctx.evt.{type_}", ordered_consumer=True)  # every message of the type, in order
    try:
        for ev, position in zip(sent, res["positions"], strict=True):
            msg = await sub.next_msg(timeout=30)
            assert msg.headers["Nats-Msg-Id"] == ev["eventId"]
            row = await pg.fetchrow(
                "SELECT version, position, data::text AS data, metadata::text AS metadata, recorded_at "
                "FROM persistence.events WHERE event_id = $1", uuid.UUID(ev["eventId"]))
            assert row["position"] == position
            # stored: the caller's JSON, compact, its keys in the order sent
            assert row["data"] == compact(ev["data"])
            assert list(json.loads(row["metadata"]))[-2:] == ["zeta", "alpha"]
            # published: the stored text, byte for byte, in the event's envelope
            expected = (
                f'{{"eventId":"{ev["eventId"]}","streamId":{compact(stream)},"type":"{type_}",'
                f'"version":{row["version"]},"position":{position},"data":{row["data"]},'
                f'"metadata":{row["metadata"]},"recordedAt":"{row["recorded_at"].isoformat()}"}}').encode()
            assert msg.data == expected
            assert json.loads(msg.data)["data"] == ev["data"]
    finally:
        await sub.unsubscribe()
