"""Persistence encodes an event's JSON once: the text measured against the size limit is the text stored, and the
relay publishes the stored text as is. These pin that the single encoding gives exactly the bytes the former
encode-per-use gave (stored and published alike)."""

import json
import uuid
from datetime import UTC, datetime

import pytest
from ctxbuild_persistence.adapters.event_store import dumps, encode, event_json, row_to_event, stored_texts
from ctxbuild_persistence.adapters.outbox import event_headers
from ctxbuild_persistence.app.events import to_new_events
from ctxbuild_persistence.app.models import AppendEvent
from ctxbuild_persistence.domain.append import NewEvent
from ctxbuild_platform.errors import InvalidPayload

TRICKY = [
    {},
    {"z": 1, "a": "é ☃ 😀", "nul": "a\x00b", "ls": "\u2028\u2029", "ctl": "\t\n\x1f", "quote": "\"\\/"},
    {"f": 0.1, "big": 12345678901234567890, "e": 1e300, "neg": -0.0, "tiny": 5e-324, "t": True, "n": None},
    {"nested": {"b": [1, {"c": None}, []], "a": {}}, "日本": ["語", {"ключ": "значение"}]},
    {"lone": "x\ud800y"},  # no UTF-8 form: stored \u-escaped
    {"\udfff": 1},
]


def compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@pytest.mark.parametrize("value", TRICKY)
def test_encode_is_the_compact_text_and_its_utf8_size(value):
    text, size = encode(value)
    try:
        expected = compact(value)
        expected.encode("utf-8")
    except UnicodeEncodeError:
        expected = json.dumps(value, separators=(",", ":"))
    assert text == expected == dumps(value)
    assert size == len(text.encode("utf-8"))
    assert json.loads(text) == value


def row(data: dict, metadata: dict, stream_id: str = "test:é") -> dict:
    """A claimed row as the relay gets it: data and metadata as their stored text (``::text``)."""
    return {"event_id": uuid.uuid4(), "stream_id": stream_id, "type": "ThingHappened", "version": 3,
            "position": 12345, "data": dumps(data), "metadata": dumps(metadata),
            "recorded_at": datetime(2026, 12, 2, 4, 35, 8, 123456, tzinfo=UTC)}


@pytest.mark.parametrize("data", TRICKY[:4])
def test_the_published_body_is_the_stored_text_and_what_decoding_then_encoding_gave(data):
    r = row(data, {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "note": "ü"})
    body = event_json(r)
    assert body == dumps(row_to_event(r))  # the bytes consumers got before, when the relay decoded and re-encoded
    assert f'"data":{r["data"]},"metadata":{r["metadata"]},' in body  # the stored text, spliced as is
    assert json.loads(body)["data"] == json.loads(r["data"])


def test_a_stored_text_is_published_as_is_even_when_decoding_would_change_it():
    r = row({}, {})
    r["data"] = '{"lone":"\\ud800","b":"é"}'  # escaped as stored; a decode + encode would give different bytes
    assert '"data":{"lone":"\\ud800","b":"é"},' in event_json(r)


def test_headers_carry_the_trace_context_only_when_it_is_a_clean_string():
    tp = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    h = event_headers(row({}, {"traceparent": tp, "tracestate": "x\ny", "other": 1}))
    assert h["traceparent"] == tp and "tracestate" not in h
    assert (h["Ctx-Event-Version"], h["Ctx-Position"], h["Ctx-Stream-Id"]) == ("3", "12345", "test:é")
    assert "traceparent" not in event_headers(row({}, {"traceparent": 7}))


def append_event(data: dict, metadata: dict | None = None) -> AppendEvent:
    return AppendEvent.model_validate({"eventId": str(uuid.uuid4()), "type": "ThingHappened", "data": data,
                                       "metadata": metadata})


def test_to_new_events_stores_the_text_it_measured():
    data = {"b": "é😀", "a": [1, 2.5]}
    (ev,) = to_new_events([append_event(data, {"k": "v"})], 64 * 1024, "test:x")
    assert (ev.data_json, ev.metadata_json) == (compact(data), compact(ev.metadata))
    assert stored_texts(ev) == (ev.data_json, ev.metadata_json)
    assert list(json.loads(ev.data_json)) == ["b", "a"]  # the caller's key order


def test_the_size_limit_counts_utf8_bytes_of_data_and_metadata():
    data = {"s": "é" * 10}  # 20 bytes of UTF-8 in 10 characters
    (ev,) = to_new_events([append_event(data)], 10**6, "test:x")
    size = len(ev.data_json.encode()) + len(ev.metadata_json.encode())
    assert len(to_new_events([append_event(data)], size, "test:x")) == 1
    with pytest.raises(InvalidPayload) as exc:
        to_new_events([append_event(data)], size - 1, "test:x")
    assert exc.value.details == {"eventIndex": 0, "bytes": size, "limit": size - 1}


def test_an_event_built_without_its_text_is_encoded_by_the_store():
    ev = NewEvent(str(uuid.uuid4()), "ThingHappened", {"a": "é"}, {"m": 1})
    assert stored_texts(ev) == ('{"a":"é"}', '{"m":1}')
