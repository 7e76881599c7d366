"""Blob store domain (SPEC §6): fs_read pages and errors, read_file pages, prefix resolution, attachment
handles — pinned with literal strings, and every result checked against the subject's reply contract."""

import pytest
from ctxbuild_blobstore.domain import (
    fs_read_error,
    fs_read_page,
    read_file_error,
    read_file_page,
    resolve_prefix,
    split_lines,
    unique_handle,
)
from ctxbuild_blobstore.domain.binary import decode_text
from ctxbuild_blobstore.domain.cache import ByteCache
from ctxbuild_blobstore.domain.fsread import Candidate, Resolved, suggested_limit
from ctxbuild_platform import contracts


def fs_ok(result):
    contracts.validate("subjects/ctx.blob.fs_read.reply.json", result)
    return result


def rf_ok(result):
    contracts.validate("subjects/ctx.blob.read_file.reply.json", result)
    return result


# ---------- fs_read ----------
def test_split_lines_drops_one_trailing_empty_piece():
    assert split_lines("a\nb\n") == ["a", "b"]
    assert split_lines("a\nb") == ["a", "b"]
    assert split_lines("a\n\n") == ["a", ""]
    assert split_lines("\n") == [""]
    assert split_lines("") == []
    assert split_lines("a\r\nb") == ["a\r", "b"]  # only \n splits


def test_first_page_with_continuation_hint():
    r = fs_ok(fs_read_page("alpha\nbeta\ngamma\n", offset=1, limit=2))
    assert r == {
        "kind": "text",
        "text": "     1\talpha\n     2\tbeta",
        "startLine": 1, "endLine": 2, "totalLines": 3,
        "modelText": "     1\talpha\n     2\tbeta\n\n"
                     "[showing lines 1-2 of 3; 1 more — call again with offset=3 to continue]",
    }


def test_last_page_has_no_hint():
    r = fs_ok(fs_read_page("alpha\nbeta\ngamma\n", offset=3, limit=2))
    assert r == {"kind": "text", "text": "     3\tgamma", "startLine": 3, "endLine": 3, "totalLines": 3,
                 "modelText": "     3\tgamma"}


def test_defaults_read_2000_lines():
    text = "".join(f"l{i}\n" for i in range(1, 2501))
    r = fs_ok(fs_read_page(text))
    assert (r["startLine"], r["endLine"], r["totalLines"]) == (1, 2000, 2500)
    assert r["text"].endswith("  2000\tl2000")
    assert r["modelText"].endswith("[showing lines 1-2000 of 2500; 500 more — call again with offset=2001 to continue]")


def test_line_numbers_are_right_aligned_to_width_six_and_may_overflow():
    text = "\n".join(str(i) for i in range(1, 1_000_002))
    r = fs_ok(fs_read_page(text, offset=999_999, limit=3, cap=50_000))
    assert r["text"] == "999999\t999999\n1000000\t1000000\n1000001\t1000001"


def test_empty_lines_and_tabs_kept_verbatim():
    r = fs_ok(fs_read_page("a\n\n\tb", offset=1, limit=10))
    assert r["text"] == "     1\ta\n     2\t\n     3\t\tb"


def test_empty_blob_reads_as_nothing():
    r = fs_ok(fs_read_page(""))
    assert r == {"kind": "text", "text": "", "startLine": 1, "endLine": 0, "totalLines": 0,
                 "modelText": "[the file is empty: 0 lines]"}


def test_offset_past_end():
    r = fs_ok(fs_read_page("a\nb", offset=3))
    assert r == {"kind": "error", "code": "offset-out-of-range",
                 "message": "offset 3 is past the end of the file (2 lines); use 1..2",
                 "modelText": "[Error: offset-out-of-range] offset 3 is past the end of the file (2 lines); use 1..2"}


def test_page_over_cap_suggests_a_limit_that_fits():
    text = "\n".join("x" * 48 for _ in range(100))  # each rendered line: 6 + 1 + 48 = 55 chars
    r = fs_ok(fs_read_page(text, offset=1, limit=100, cap=2000))
    # page = 100*55 + 99 = 5599 chars; floor((2000-200) / (5599/100)) = floor(32.15) = 32
    assert r == {"kind": "error", "code": "output-too-large",
                 "message": "lines 1-100 render to 5599 chars, over the 2000-char read cap; call again with limit=32",
                 "modelText": "[Error: output-too-large] lines 1-100 render to 5599 chars, over the 2000-char "
                              "read cap; call again with limit=32"}
    ok = fs_ok(fs_read_page(text, offset=1, limit=32, cap=2000))
    assert ok["kind"] == "text" and len(ok["text"]) == 32 * 55 + 31 <= 2000


def test_page_exactly_at_cap_is_served():
    text = "\n".join("y" * 93 for _ in range(20))  # 20 * 100 + 19 = 2019 chars rendered
    assert fs_read_page(text, limit=20, cap=2019)["kind"] == "text"
    assert fs_read_page(text, limit=20, cap=2018)["code"] == "output-too-large"


def test_suggested_limit_formula():
    assert suggested_limit(page_chars=5599, page_lines=100, cap=2000) == 32
    assert suggested_limit(page_chars=10_000, page_lines=2, cap=2000) == 1  # never below 1
    assert suggested_limit(page_chars=60_000, page_lines=2000, cap=50_000) == 1660


def test_a_line_longer_than_a_page_is_cut_and_every_char_is_reachable():
    """A long JSON one-liner: each page shows a piece of the line and names the column to continue from."""
    line = "".join(f'{{"k{i}": "{i * 7}"}},' for i in range(900))   # ≈ 13,000 chars, one line
    text = f"head\n{line}\ntail\n"
    r = fs_ok(fs_read_page(text, offset=2, limit=5, cap=2000))
    assert r["kind"] == "text" and r["startLine"] == r["endLine"] == 2 and r["nextColumn"] == 1 + 1793
    assert r["text"] == "     2\t" + line[:1793] and len(r["text"]) <= 2000 - 200
    assert r["modelText"].endswith("[line 2 is longer than one page: showing its chars 1-1793; call again with "
                                   "offset=2, column=1794 to continue the line]")
    pieces, column = [], 1
    while True:
        r = fs_ok(fs_read_page(text, offset=2, limit=5, cap=2000, column=column))
        pieces.append(r["text"].split("\t", 1)[1].split("\n", 1)[0])
        if "nextColumn" not in r:
            break
        column = r["nextColumn"]
    assert "".join(pieces) == line   # every character, in order, nothing twice
    assert r["text"].endswith("     3\ttail") and r["endLine"] == 3   # the last piece and the lines after it


def test_error_result_shape():
    assert fs_ok(fs_read_error("parse-error", "bad")) == {"kind": "error", "code": "parse-error", "message": "bad",
                                                          "modelText": "[Error: parse-error] bad"}


# ---------- prefix resolution (the 16-hex name is only a handle) ----------
P = "0123456789abcdef"
A = P + "a" * 48
B = P + "b" * 48


def test_unknown_prefix_is_not_found():
    r = fs_ok(resolve_prefix(P, []))
    assert (r["code"], r["message"]) == ("not-found", "no stored output vfs_0123456789abcdef.txt")


def test_blob_of_another_conversation_is_denied():
    r = fs_ok(resolve_prefix(P, [Candidate(A, 10, allowed=False)]))
    assert r["modelText"] == "[Error: access-denied] vfs_0123456789abcdef.txt is not readable from this conversation"


def test_colliding_prefix_is_never_served_even_if_one_is_allowed():
    r = fs_ok(resolve_prefix(P, [Candidate(A, 10, True), Candidate(B, 20, False)]))
    assert r["code"] == "ambiguous-handle"
    assert r["message"] == ("vfs_0123456789abcdef.txt names 2 different stored outputs; refusing to guess which one")


def test_single_allowed_candidate_resolves_to_full_hash():
    assert resolve_prefix(P, [Candidate(A, 10, True)]) == Resolved(A, 10)


# ---------- read_file ----------
def test_read_file_first_page_with_hint():
    r = rf_ok(read_file_page("abcdefghij", offset=0, limit=4))
    assert r == {"text": "abcd", "totalChars": 10, "nextOffset": 4,
                 "modelText": "abcd\n\n[Showing 4 of 10 chars. Call read_file again with offset=4 for more.]"}


def test_read_file_last_page_has_no_next_offset():
    r = rf_ok(read_file_page("abcdefghij", offset=8, limit=4))
    assert r == {"text": "ij", "totalChars": 10, "modelText": "ij"}


def test_read_file_defaults_to_8000_chars():
    r = rf_ok(read_file_page("z" * 10_000))
    assert len(r["text"]) == 8000 and r["nextOffset"] == 8000
    assert r["modelText"].endswith("\n\n[Showing 8000 of 10000 chars. Call read_file again with offset=8000 for more.]")


def test_read_file_never_splits_an_astral_character_and_always_advances():
    text = "😀é😀x"
    pages, offset = [], 0
    while True:
        r = rf_ok(read_file_page(text, offset=offset, limit=1))
        pages.append(r["text"])
        if "nextOffset" not in r:
            break
        assert r["nextOffset"] > offset
        offset = r["nextOffset"]
    assert pages == ["😀", "é", "😀", "x"]
    assert all(p.encode("utf-8", "strict") for p in pages)  # no lone surrogates


def test_read_file_offset_past_end():
    r = rf_ok(read_file_page("abcdefghij", offset=10))
    assert r == {"error": {"code": "offset-out-of-range",
                           "message": "offset 10 is past the end of the file (10 chars); use 0..9"},
                 "modelText": "[Error: offset-out-of-range] offset 10 is past the end of the file (10 chars); "
                              "use 0..9"}


def test_read_file_empty_file():
    assert rf_ok(read_file_page("")) == {"text": "", "totalChars": 0, "modelText": ""}
    assert rf_ok(read_file_page("", offset=1))["error"]["code"] == "offset-out-of-range"


def test_read_file_error_shape():
    assert rf_ok(read_file_error("not-found", "no such file")) == {
        "error": {"code": "not-found", "message": "no such file"}, "modelText": "[Error: not-found] no such file"}


# ---------- attachment handles ----------
@pytest.mark.parametrize(("name", "taken", "expected"), [
    ("a.txt", set(), "a.txt"),
    ("a.txt", {"b.txt"}, "a.txt"),
    ("a.txt", {"a.txt"}, "a.txt (2)"),
    ("a.txt", {"a.txt", "a.txt (2)"}, "a.txt (3)"),
    ("a.txt", {"a.txt", "a.txt (3)"}, "a.txt (2)"),  # first free number
    ("a.txt (2)", {"a.txt (2)"}, "a.txt (2) (2)"),
    ("report", {"report", "report (2)", "report (3)", "report (4)"}, "report (5)"),
])
def test_unique_handle(name, taken, expected):
    assert unique_handle(name, taken) == expected


# ---------- text decoding / cache ----------
def test_decode_text():
    assert decode_text("héllo\n".encode()) == "héllo\n"
    assert decode_text(b"\x89PNG\r\n\x1a\n\x00\x00") is None  # NUL → binary
    assert decode_text(b"\xff\xfe") is None  # not UTF-8


def test_byte_cache_is_bounded_lru():
    c = ByteCache(max_bytes=400)
    c.put("a", b"A" * 100)
    c.put("b", b"B" * 100)
    c.put("c", b"C" * 100)
    assert c.get("a") == b"A" * 100  # a is now the most recent
    c.put("d", b"D" * 100)
    c.put("e", b"E" * 100)  # over 400: evicts the least recent (b)
    assert c.get("b") is None and c.get("a") == b"A" * 100 and c.get("e") == b"E" * 100
    c.put("huge", b"H" * 101)  # > max/4: never cached
    assert c.get("huge") is None
    c.discard("a")
    assert c.get("a") is None
