"""fs_read with a pattern (SPEC §15.2), pure: only the matching lines, numbered like a page, within the page cap;
an invalid pattern and a catastrophic one are model-facing error results, never a hang or a failed request."""

from __future__ import annotations

import random

import pytest
from ctxbuild_blobstore.domain.fsread import (
    LineSearch,
    compile_pattern,
    count_lines,
    fs_read_page,
    fs_read_search,
)
from ctxbuild_platform import contracts

TEXT = "".join(f"2026-11-29T10:00:{i % 60:02d}Z {'ERROR' if i % 37 == 5 else 'INFO'} item={i}\n" for i in range(1, 401))


def ok(result: dict) -> dict:
    contracts.validate("subjects/ctx.blob.fs_read.reply.json", result)
    return result


def test_only_the_matching_lines_with_their_numbers():
    r = ok(fs_read_search(TEXT, r"ERROR item=\d+"))
    hits = [i for i in range(1, 401) if i % 37 == 5]
    assert r["matches"] == len(hits) and r["startLine"] == 1 and r["endLine"] == 400 and r["totalLines"] == 400
    # the same rendering as a page: each matching line exactly as fs_read shows it at its number
    assert r["text"].split("\n") == [fs_read_page(TEXT, offset=n, limit=1)["text"] for n in hits]
    assert r["modelText"] == r["text"] + f"\n\n[{len(hits)} matching lines in lines 1-400 of 400]"


def test_offset_and_limit_bound_the_search_and_no_match_says_so():
    r = ok(fs_read_search(TEXT, "ERROR", offset=50, limit=40))
    assert [int(x.split("\t")[0]) for x in r["text"].split("\n")] == [79]
    none = ok(fs_read_search(TEXT, "WARN"))
    assert none["matches"] == 0 and none["text"] == ""
    assert none["modelText"] == "[no line matches the pattern in lines 1-400 of 400]"


def test_many_matches_stop_at_the_cap_and_say_where_to_continue():
    r = ok(fs_read_search(TEXT, "INFO", cap=2_000))
    assert len(r["modelText"]) <= 2_000 and 0 < r["matches"] < 390
    last = int(r["text"].split("\n")[-1].split("\t")[0])
    assert r["endLine"] == last
    assert r["modelText"].endswith(f"more may match — call again with offset={last + 1} and the same pattern "
                                   "to continue]")
    following = ok(fs_read_search(TEXT, "INFO", offset=last + 1, cap=2_000))
    assert int(following["text"].split("\n")[0].split("\t")[0]) > last


def test_an_invalid_pattern_is_a_result_the_model_reads():
    r = ok(fs_read_search(TEXT, "item=(\\d+"))
    assert r["kind"] == "error" and r["code"] == "invalid-pattern"
    assert r["modelText"].startswith("[Error: invalid-pattern] the pattern is not a valid regular expression")


@pytest.mark.timeout(60)
def test_a_catastrophic_pattern_is_stopped_by_its_time_bound():
    """(a+)+$ on a long run of a's ending in b backtracks exponentially; the regex timeout ends it."""
    text = "fine line\n" + "a" * 5_000 + "b\n"
    r = ok(fs_read_search(text, r"(a+)+$", timeout_s=0.2))
    assert r["kind"] == "error" and r["code"] == "pattern-timeout"
    assert "stopped at line 2" in r["message"]


def test_the_deadline_covers_the_whole_search_not_one_line():
    ticks = iter(range(100))
    search = LineSearch(compile_pattern("x"), first_line=1, offset=1, limit=None, total_lines=20, cap=50_000,
                        timeout_s=5, clock=lambda: next(ticks))   # every line costs one "second"
    search.feed("x\n" * 20)
    r = search.result()
    assert r["code"] == "pattern-timeout" and "stopped at line 5" in r["message"]


def test_a_long_matching_line_is_shown_around_the_match_with_its_column():
    line = "".join(f'{{"k{i}": {i}}}, ' for i in range(3_000)) + '{"needle": true}'
    text = f"a\n{line}\nb\n"
    r = ok(fs_read_search(text, "needle", cap=2_000))
    assert r["matches"] == 1
    shown = r["text"].split("\t", 1)[1]
    column = int(shown.rsplit("column=", 1)[1].rstrip("]"))
    assert '{"needle": true}' in shown and shown.startswith(line[column - 1: column + 20])
    assert len(r["modelText"]) <= 2_000
    # the column leads back to the same place with an ordinary page read
    page = ok(fs_read_page(text, offset=2, limit=1, cap=2_000, column=column))
    assert page["text"].split("\t", 1)[1].startswith(line[column - 1: column + 200])


def test_any_split_of_the_stream_gives_the_same_result():
    rnd = random.Random(7)
    pattern = compile_pattern(r"ERROR|item=3\d\b")
    whole = fs_read_search(TEXT, r"ERROR|item=3\d\b", offset=3, limit=300, cap=3_000)
    for _ in range(200):
        cuts = sorted(rnd.sample(range(len(TEXT) + 1), 6))
        search = LineSearch(pattern, first_line=1, offset=3, limit=300, total_lines=count_lines(TEXT), cap=3_000,
                            timeout_s=5)
        for a, b in zip([0, *cuts], [*cuts, len(TEXT)], strict=True):
            if search.feed(TEXT[a:b]):
                break
        assert search.result() == whole
