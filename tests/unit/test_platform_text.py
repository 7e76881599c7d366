"""Text that can be stored: the one walker the edge, persistence and the runner share."""

from __future__ import annotations

import json

from ctxbuild_platform.text import LONE_SURROGATE, first_bad_text, storable


def test_tool_output_with_lone_surrogates_becomes_storable_utf8():
    output = {"type": "content", "value": [{"type": "text", "text": "bad \ud800 byte, good \U0001F600"}],
              "metadata": {"structuredContent": {"k\udc01": ["\ud83d\ude00", 7, None]}}}
    clean = storable(output)
    json_bytes = str(clean).encode("utf-8")  # raises if any lone surrogate is left
    assert json_bytes and clean["value"][0]["text"] == "bad \ufffd byte, good \U0001F600"
    assert clean["metadata"]["structuredContent"] == {"k\ufffd": ["\U0001F600", 7, None]}  # a split pair rejoins
    plain = {"type": "text", "value": "valid text"}
    assert storable(plain) == plain


def test_first_bad_text_names_the_path_the_character_and_where_it_is():
    found = first_bad_text({"title": "ok", "settings": {"notes": ["fine", "a\x00b"]}}, "body")
    assert (found.path, found.char, found.index, found.in_key) == ("body.settings.notes[1]", "\x00", 1, False)
    assert found.describe() == "a NUL character"
    key = first_bad_text({"k\ud800": 1}, "body")
    assert key.in_key and key.path == "body" and key.describe() == "a lone surrogate (U+D800)"
    assert first_bad_text({"a": "\x00"}, "data", LONE_SURROGATE) is None  # NUL is fine where only UTF-8 matters
    assert first_bad_text(json.loads('{"a": "\\ud83d\\ude00"}'), "data") is None  # a JSON pair is one char
