"""The streaming halves of fs_read/read_file and the seek index (pure): a page served from any split of the
text, starting at any seek mark, is byte-identical to the page of the whole text (the reference semantics)."""

import random

import pytest
from ctxbuild_blobstore.domain import (
    CharPager,
    Indexer,
    LinePager,
    count_lines,
    fs_read_page,
    index_bytes,
    read_file_page,
    split_lines,
)
from ctxbuild_blobstore.domain.fsread import fs_read_error, nothing_to_read, render_lines, suggested_limit
from ctxbuild_platform import contracts


def reference_fs_read(text: str, offset: int, limit: int, cap: int, column: int = 1) -> dict:
    """fs_read exactly as specified (SPEC §6, §15.2), on the whole text: the walking skeleton's implementation,
    plus the cut of a first line longer than one page (shown from ``column``, continued by ``nextColumn``)."""
    lines = split_lines(text)
    total = len(lines)
    if (early := nothing_to_read(offset, total)) is not None:  # (its two answers are pinned literally elsewhere)
        return early
    first = lines[offset - 1][column - 1:]
    room = max(1, cap - 200 - 7)
    if len(first) > room:
        body = f"{offset:>6}\t{first[:room]}"
        return {"kind": "text", "text": body, "startLine": offset, "endLine": offset, "totalLines": total,
                "nextColumn": column + room,
                "modelText": body + f"\n\n[line {offset} is longer than one page: showing its chars "
                                    f"{column}-{column + room - 1}; call again with offset={offset}, "
                                    f"column={column + room} to continue the line]"}
    page = [first, *lines[offset: offset - 1 + limit]]
    end = offset + len(page) - 1
    body = render_lines(page, offset)
    if len(body) > cap:
        if len(page) == 1:
            return fs_read_error("output-too-large", f"line {offset} alone renders to {len(body)} chars, over the "
                                                     f"{cap}-char read cap; it cannot be shown by fs_read")
        return fs_read_error("output-too-large", f"lines {offset}-{end} render to {len(body)} chars, over the "
                                                 f"{cap}-char read cap; call again with "
                                                 f"limit={suggested_limit(len(body), len(page), cap)}")
    model = body
    if total - end > 0:
        model += (f"\n\n[showing lines {offset}-{end} of {total}; {total - end} more — "
                  f"call again with offset={end + 1} to continue]")
    return {"kind": "text", "text": body, "startLine": offset, "endLine": end, "totalLines": total,
            "modelText": model}


ALPHABET = ["a", "bc", "\n", "\n", "\n\n", "é", "😀", "\t", "x" * 40, "", "𝄞z"]


def random_text(rnd: random.Random, n: int) -> str:
    return "".join(rnd.choice(ALPHABET) for _ in range(rnd.randint(0, n)))


def random_split(rnd: random.Random, text: str) -> list[str]:
    cuts = sorted(rnd.sample(range(len(text) + 1), min(len(text) + 1, rnd.randint(0, 8))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_line_pager_matches_the_reference_for_any_split():
    rnd = random.Random(4)
    for _ in range(6000):
        text = random_text(rnd, 80)
        total = count_lines(text)
        offset, limit, cap = rnd.randint(1, total + 2), rnd.randint(1, 9), rnd.randint(8, 300)
        column = rnd.choice([1, 1, rnd.randint(1, 50)])
        pager = LinePager(first_line=1, offset=offset, limit=limit, total_lines=total, cap=cap, column=column)
        for piece in random_split(rnd, text):
            if pager.feed(piece):
                break
        got = pager.result()
        assert got == reference_fs_read(text, offset, limit, cap, column), (text, offset, limit, cap, column)
        contracts.validate("subjects/ctx.blob.fs_read.reply.json", got)


def indexed_texts(seed: int, n: int = 1500):
    """``n`` random texts with their UTF-8 bytes and seek index (marks every 16 bytes), and the generator."""
    rnd = random.Random(seed)
    for _ in range(n):
        text = random_text(rnd, 300)
        data = text.encode()
        yield rnd, text, data, index_bytes(data, stride=16)


def test_line_pager_started_at_a_seek_mark_matches_the_reference():
    for rnd, text, data, ix in indexed_texts(5):
        total = count_lines(text)
        assert ix.lines == total
        offset, limit = rnd.randint(1, total + 1), rnd.randint(1, 6)
        probe = LinePager(first_line=1, offset=offset, limit=limit, total_lines=total, cap=10_000)
        if probe.done:
            continue
        first, start = ix.line_marks.floor(offset)
        end = ix.line_marks.ceil_offset(probe.last + 1)
        end = len(data) if end is None else end
        pager = LinePager(first_line=first, offset=offset, limit=limit, total_lines=total, cap=10_000)
        pager.feed(data[start:end].decode())
        assert pager.result(at_end=end == len(data)) == reference_fs_read(text, offset, limit, 10_000)


def test_char_pager_matches_whole_text_paging_from_any_char_mark():
    for rnd, text, data, ix in indexed_texts(6):
        assert ix.chars == len(text)
        offset, limit = rnd.randint(0, len(text) + 1), rnd.randint(1, 40)
        first, start = ix.char_marks.floor(offset)
        assert data[:start].decode() == text[:first]  # a mark is a character boundary with its char offset
        pager = CharPager(first_char=first, offset=offset, limit=limit, total_chars=len(text))
        for piece in random_split(rnd, data[start:].decode()):
            if pager.feed(piece):
                break
        assert pager.result() == read_file_page(text, offset, limit)


def test_read_file_pages_never_split_astral_characters_across_chunk_borders():
    text = "😀" * 5000 + "é" * 5000 + "𝄞" * 5000
    data = text.encode()
    ix = index_bytes(data, stride=1000)  # marks fall at character boundaries even mid-emoji runs
    assert len(ix.char_marks) > 10
    pages, offset = [], 0
    while True:
        first, start = ix.char_marks.floor(offset)
        pager = CharPager(first_char=first, offset=offset, limit=777, total_chars=len(text))
        pager.feed(data[start:].decode())
        r = pager.result()
        pages.append(r["text"])
        if "nextOffset" not in r:
            break
        offset = r["nextOffset"]
    assert "".join(pages) == text
    assert all(p.encode("utf-8", "strict") for p in pages)


@pytest.mark.parametrize(("text", "lines"), [("", 0), ("a", 1), ("a\n", 1), ("a\n\n", 2), ("\n", 1), ("a\nb", 2)])
def test_index_line_count_follows_fs_read(text, lines):
    assert index_bytes(text.encode()).lines == lines == len(split_lines(text))


def test_index_marks_point_at_line_starts_and_stay_bounded():
    text = "".join(f"{i:07d} {'y' * (i % 50)}\n" for i in range(40_000))
    data = text.encode()
    ix = Indexer(stride=1024, max_marks=64)
    for i in range(0, len(data), 7777):  # arbitrary feed sizes
        ix.feed(data[i:i + 7777])
    res = ix.finish()
    assert res.lines == 40_000 and res.chars == len(text) and res.size == len(data) and res.is_text
    assert 2 < len(res.line_marks) <= 64 and len(res.char_marks) <= 64  # thinned, never unbounded
    for n, off in zip(res.line_marks.keys, res.line_marks.offsets, strict=True):
        assert off == 0 or data[off - 1] == 0x0A
        assert data[off:off + 7].decode() == f"{n - 1:07d}"


def test_index_detects_binary():
    assert not index_bytes(b"abc\x00def").is_text  # NUL early: binary, as decode_text says
    assert not index_bytes(b"ok" * 10 + b"\xff\xfe").is_text  # not UTF-8
    assert index_bytes(b"a" * 9000 + b"\x00").is_text  # a NUL after the sniffed 8 KB is still text
    split = "é".encode()
    ix = Indexer(stride=16)
    ix.feed(b"x" * 15 + split[:1])
    ix.feed(split[1:] + b"y")  # a character split across feeds (and windows) is fine
    r = ix.finish()
    assert r.is_text and r.chars == 17 and r.lines == 1


@pytest.mark.parametrize("seed", range(40))
def test_index_counts_and_char_marks_match_the_text_for_any_stride_and_feed(seed):
    """ASCII windows are counted without decoding; whatever mix of ASCII runs and multi-byte characters across
    window borders, the facts and every char mark are those of the decoded text."""
    rnd = random.Random(seed)
    text = "".join(rnd.choice(["plain ascii line\n", "x" * rnd.randint(1, 40), "é", "😀", "\n", "𝄞"])
                   for _ in range(rnd.randint(1, 400)))
    data = text.encode()
    ix = Indexer(stride=rnd.choice([16, 17, 31, 64]), max_marks=rnd.choice([2, 8, 4096]))
    i = 0
    while i < len(data):
        n = rnd.randint(1, 50)
        ix.feed(data[i:i + n])
        i += n
    res = ix.finish()
    assert res.is_text and res.chars == len(text) and res.lines == len(split_lines(text)) and res.size == len(data)
    for chars, off in zip(res.char_marks.keys, res.char_marks.offsets, strict=True):
        assert len(data[:off].decode()) == chars  # a mark sits on a character boundary and counts right


def test_an_ascii_window_after_a_cut_character_is_still_validated():
    ix = Indexer(stride=16)
    ix.feed(b"x" * 15 + b"\xc3" + b"y" * 16)  # a lead byte, then a window of pure ASCII: not UTF-8
    assert not ix.finish().is_text
    assert not index_bytes(b"a" * 20 + b"\x80" + b"b" * 40).is_text  # a stray continuation byte


def test_fs_read_page_of_a_huge_line_is_counted_not_held():
    pager = LinePager(first_line=1, offset=1, limit=3, total_lines=3, cap=1000)
    pager.feed("short\n")
    for _ in range(100):
        pager.feed("z" * 10_000)  # one 1 MB line, fed in pieces
    assert pager._cur == [] and pager._kept == []  # nothing held past the cap
    pager.feed("\nend")
    r = pager.result()
    assert r["code"] == "output-too-large"
    assert r["message"] == ("lines 1-3 render to 1000031 chars, over the 1000-char read cap; call again with limit=1")
    assert fs_read_page("short\n" + "z" * 1_000_000 + "\nend", limit=3, cap=1000) == r
