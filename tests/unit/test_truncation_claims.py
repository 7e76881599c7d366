"""Claim checks: a text measured while it streams back (two windows + totals) gives exactly the codec's cut of the
whole text, hence exactly the marker the inline path serves. Pinned on random texts and random chunkings."""

from __future__ import annotations

import itertools
import random

import pytest
from ctxbuild_codec import apply_inflight, plan_inflight, sha256_hex, vfs_uri
from ctxbuild_codec.lanes import measure
from ctxbuild_platform.errors import InvalidPayload
from ctxbuild_truncation.domain import ClaimMeter, claim_plan, measured_cut, parse_claims
from hypothesis import given, settings
from hypothesis import strategies as st

ALPHABET = st.sampled_from(["a", "b", " ", "\n", "\n\n", "é", "中", "😀", "\r\n", "x" * 37])


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def meter_of(text: str, cuts: list[int], keep: int = 0):
    m = ClaimMeter(keep)
    for piece in chunked(text.encode(), cuts):
        m.feed(piece)
    return m.finish()


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(ALPHABET, min_size=0, max_size=1200), cuts=st.lists(st.integers(0, 10**6), max_size=12))
def test_streamed_cut_equals_the_codecs_cut_of_the_whole_text(pieces, cuts):
    text = "".join(pieces)
    m = meter_of(text, cuts)
    whole = measure(text)
    assert (m.chars, m.lines, m.size) == (len(text), text.count("\n") + 1, len(text.encode()))
    if len(text) > 501:  # below that nothing is ever trimmed (and the head window is the whole text)
        cut = measured_cut(m, whole.sha256)
        assert (cut.sha256, cut.uri, cut.head, cut.tail, cut.total_lines, cut.total_chars) == \
            (whole.sha256, whole.uri, whole.head, whole.tail, whole.total_lines, whole.total_chars)


@pytest.mark.parametrize("seed", range(20))
def test_claimed_part_renders_what_the_inline_part_renders(seed):
    rng = random.Random(seed)
    lines = [("é" if rng.random() < 0.1 else "") + "w" * rng.randint(0, 120) for _ in range(rng.randint(30, 900))]
    text = "\n".join(lines) + ("\n" if rng.random() < 0.5 else "")
    kind = rng.choice(["text", "error-text"])
    name = rng.choice(["mcp__shell__run_0123", "web_fetch", "bash"])
    threshold = 2_000
    inline = {"type": "tool-result", "toolCallId": "c", "toolName": name, "output": {"type": kind, "value": text}}
    claimed = {**inline, "output": {"type": kind, "value": ""}}
    plan = plan_inflight(inline, threshold)
    m = meter_of(text, [rng.randint(0, len(text.encode())) for _ in range(rng.randint(0, 8))])
    cplan = claim_plan(claimed, threshold, sha256_hex(text), m)
    if plan is None:
        assert cplan is None
        return
    written = {sha256_hex(text): vfs_uri(sha256_hex(text))}
    assert apply_inflight(claimed, cplan, written) == apply_inflight(inline, plan, written)


def test_claim_rules_come_from_the_codec():
    text = "line\n" * 2_000
    m = meter_of(text, [4096])
    sha = sha256_hex(text)
    part = {"type": "tool-result", "toolCallId": "c", "toolName": "fs_read", "output": {"type": "text", "value": ""}}
    assert claim_plan(part, 2_000, sha, m) is None  # fs_read is not truncatable in flight
    via_invoke = {**part, "toolName": "tool_invoke", "effectiveToolName": "fs_read"}
    assert claim_plan(via_invoke, 2_000, sha, m) is None
    other = {**part, "toolName": "mcp__x__y_0"}
    assert claim_plan(other, 20_000, sha, m) is None  # 10,000 chars: under the threshold
    assert claim_plan(other, 2_000, sha, m) is not None


def test_meter_keeps_the_text_only_while_small():
    text = "abc\n" * 1000
    assert meter_of(text, [7, 999], keep=10_000).kept == text
    assert meter_of(text, [7, 999], keep=3_999).kept is None


def test_meter_refuses_bytes_that_are_not_utf8():
    m = ClaimMeter()
    with pytest.raises(InvalidPayload):
        m.feed(b"ok\xff\xfe")
    m = ClaimMeter()
    m.feed("é".encode()[:1])
    with pytest.raises(InvalidPayload):
        m.finish()


def req(parts, claims):
    return {"conversationId": "c", "turnId": "t", "parts": parts, "claims": claims}


def part(output, **extra):
    return {"type": "tool-result", "toolCallId": "c", "toolName": "x", "output": output, **extra}


SHA = "ab" * 32


def test_parse_claims():
    ok = parse_claims(req([part({"type": "text", "value": "x"}), part({"type": "error-text", "value": ""})],
                          [{"part": 1, "sha256": SHA, "uri": vfs_uri(SHA), "size": 9}]))
    assert list(ok) == [1] and ok[1].size == 9
    bad = [
        ([part({"type": "text", "value": ""})], [{"part": 1, "sha256": SHA}]),                       # out of range
        ([part({"type": "text", "value": ""})], [{"part": 0, "sha256": SHA}, {"part": 0, "sha256": SHA}]),  # twice
        ([part({"type": "text", "value": ""})], [{"part": 0, "sha256": SHA, "uri": vfs_uri("cd" * 32)}]),
        ([part({"type": "text", "value": "not empty"})], [{"part": 0, "sha256": SHA}]),
        ([part({"type": "json", "value": ""})], [{"part": 0, "sha256": SHA}]),
        ([part({"type": "text", "value": ""}, offload={"mode": "inline", "totalChars": 1, "totalLines": 1})],
         [{"part": 0, "sha256": SHA}]),
    ]
    for parts, claims in bad:
        with pytest.raises(InvalidPayload):
            parse_claims(req(parts, claims))
