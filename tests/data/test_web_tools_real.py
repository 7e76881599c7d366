"""The web tools on real third-party material in ../shared/data, served by local servers on 127.0.0.1 (skips
cleanly when the folder is absent; nothing is copied here).

- the article-extraction benchmark's raw WSJ page → web_fetch → the extracted text against the benchmark's
  ground-truth ``articleBody`` (token recall, reported);
- FreshWiki's Wikipedia articles laid out as web pages → web_fetch → long entities the entities codec trims in
  both lanes while id/title/url stay exactly as fetched (finding #7);
- the STORM research run's real queries and results behind a SearXNG JSON API → web_search → the same citations,
  which survive both lanes.
"""

from __future__ import annotations

import gzip
import html
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest
from ctxbuild_codec import inflight_threshold, sha256_hex, trim_inflight, trim_persist
from ctxbuild_codec.envelopes import inflate, render
from ctxbuild_devstack import free_port
from ctxbuild_orchestration.adapters.web import SearxngBackend, web_fetch, web_search

from tests.support.fake_searxng import FakeSearxng
from tests.support.web_pages import PageServer

pytestmark = pytest.mark.shared_data

THRESHOLD = inflight_threshold(30_000, 16_000)  # 4,800 chars: a 16k-token window, as in the codec's data tests
WSJ_KEY = "042bb7b5fedab6eac7db576522b89b93904c237d344bcbe14a6a5ab7f7335856"
STORM = "trajectories/06_storm_websearch_CRW_telesystem/conversation_log.json"
TOKEN = re.compile(r"\w+")


def tokens(text: str) -> Counter[str]:
    return Counter(TOKEN.findall(text.lower()))


def recall(truth: str, got: str) -> float:
    """Share of the ground truth's word tokens (with multiplicity) found in the extracted text."""
    want = tokens(truth)
    return sum((want & tokens(got)).values()) / sum(want.values())


class Store:
    """A blob store stand-in for the lanes: keeps every text it is asked to write, acknowledges its URI."""

    def __init__(self) -> None:
        self.texts: dict[str, str] = {}

    def __call__(self, blob) -> str:
        self.texts[blob.sha256] = blob.text
        return blob.uri


def through_both_lanes(name: str, output: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], Store]:
    """The tool output as the model sees it in flight and as it is stored; citations checked on both."""
    part = {"type": "tool-result", "toolCallId": "call-1", "toolName": name, "output": output}
    store = Store()
    served = trim_inflight(part, THRESHOLD, store)
    stored = trim_persist(part, THRESHOLD, store)
    cites = [(r["id"], r["title"], r["url"]) for r in output["value"]]
    assert [(r["id"], r["title"], r["url"]) for r in served["output"]["value"]] == cites
    if stored["output"]["type"] == "persisted":
        env = stored["output"]["value"]
        assert [(r["id"], r["title"], r["url"]) for r in env["skeleton"]] == cites
        assert orjson.dumps(inflate(env, store.texts)) == orjson.dumps(output)  # every byte recoverable
        assert orjson.dumps(render(env)) == orjson.dumps(served["output"])       # what the model saw
    return served, stored, store


@pytest.fixture(scope="module")
def site():
    s = PageServer(free_port()).start()
    yield s
    s.stop()


async def fetch(url: str) -> dict[str, Any]:
    return await web_fetch(url, max_bytes=5_000_000, timeout=30, allow_private_networks=True)


# ---------- the article-extraction benchmark ----------

async def test_benchmark_page_extraction_covers_the_ground_truth(shared_data, site, record_property):
    web = shared_data / "web"
    truth = json.loads((web / "article-extraction-benchmark_ground-truth.json").read_text())[WSJ_KEY]
    raw = gzip.decompress((web / "article-extraction-benchmark_042bb7b5.html.gz").read_bytes())
    url = site.add("articles/google-stadia.html", raw, "text/html; charset=utf-8")
    out = await fetch(url)
    [item] = out["value"]
    assert item["title"] == "Google Stadia, Microsoft xCloud, Apple Arcade: So Many Ways to Play\u2026and Pay"
    assert item["url"] == url
    score = recall(truth["articleBody"], item["content"])
    record_property("token_recall", round(score, 3))
    print(f"WSJ page: {len(raw):,} bytes of HTML → {len(item['content']):,} chars; token recall {score:.3f}")
    assert score >= 0.8
    assert len(item["content"]) < len(raw) // 100  # scripts, markup and page chrome are gone
    # a short page stays whole in both lanes
    served, stored, _ = through_both_lanes("web_fetch", out)
    assert served["output"] == out and stored["output"] == out


# ---------- FreshWiki articles as web pages: long entities, trimmed ----------

def section_html(sections: list[dict[str, Any]], depth: int = 2) -> str:
    out = []
    for s in sections:
        out.append(f"<h{depth}>{html.escape(s['section_title'])}</h{depth}>")
        sentences = [x["sentence"] for x in s.get("section_content") or []]
        for i in range(0, len(sentences), 4):  # paragraphs of four sentences
            out.append("<p>" + html.escape(". ".join(sentences[i:i + 4])) + ".</p>")
        out.append(section_html(s.get("subsections") or [], min(depth + 1, 6)))
    return "\n".join(out)


def section_text(sections: list[dict[str, Any]]) -> str:
    return " ".join(" ".join(x["sentence"] for x in s.get("section_content") or []) + " " +
                    section_text(s.get("subsections") or []) for s in sections)


def wiki_page(doc: dict[str, Any]) -> str:
    """The article's real text in a page with the usual chrome around it (navigation, reference list, footer)."""
    refs = "".join(f'<li><a href="{html.escape(u)}">{html.escape(u)}</a></li>' for u in doc["references"].values())
    return f"""<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">
<title>{html.escape(doc['title'])} - Wikipedia</title></head><body>
<header><nav><a href="/">Main page</a> <a href="/random">Random article</a> <a href="/login">Log in</a></nav></header>
<main><article><h1>{html.escape(doc['title'])}</h1><p>{html.escape(doc['summary'])}</p>
{section_html(doc['content'])}</article></main>
<aside><h2>References</h2><ol>{refs}</ol></aside>
<footer>Text is available under the Creative Commons Attribution-ShareAlike License 4.0.
Privacy policy. About Wikipedia. Disclaimers.</footer></body></html>"""


async def test_long_fetched_pages_are_trimmed_with_citations_intact(shared_data, site, record_property):
    paths = sorted((shared_data / "web" / "freshwiki").glob("*.json"))
    assert len(paths) == 3
    for path in paths:
        doc = json.loads(path.read_text())
        url = site.add(f"wiki/{path.stem}", wiki_page(doc), "text/html; charset=utf-8")
        out = await fetch(url)
        [item] = out["value"]
        assert item["title"] in (doc["title"], f"{doc['title']} - Wikipedia") and item["url"] == url
        score = recall(doc["summary"] + " " + section_text(doc["content"]), item["content"])
        record_property(f"token_recall_{path.stem}", round(score, 3))
        print(f"{path.stem}: {len(item['content']):,} chars extracted, token recall {score:.3f}")
        assert score >= 0.95
        assert "Privacy policy" not in item["content"] and "Random article" not in item["content"]
        assert len(item["content"]) > THRESHOLD
        served, stored, store = through_both_lanes("web_fetch", out)
        shown = served["output"]["value"][0]["content"]
        uri = f"context://vfs/vfs_{sha256_hex(item['content'])[:16]}.txt"
        assert len(shown) < len(item["content"]) // 2 and uri in shown  # trimmed, with where the rest is
        assert store.texts[sha256_hex(item["content"])] == item["content"]
        assert stored["output"]["type"] == "persisted"


# ---------- STORM's web searches through SearXNG's API ----------

def storm_index(root: Path) -> dict[str, list[dict[str, Any]]]:
    """query → its results as the search engine returned them in the STORM run (url, title, snippets)."""
    index: dict[str, list[dict[str, Any]]] = {}
    for perspective in json.loads((root / STORM).read_text()):
        for turn in perspective["dlg_turns"]:
            for r in turn["search_results"]:
                hits = index.setdefault(r["meta"]["query"], [])
                if all(h["url"] != r["url"] for h in hits):
                    hits.append({"url": r["url"], "title": r["title"], "content": "\n".join(r["snippets"])})
    return index


async def test_storm_search_results_keep_their_citations(shared_data):
    index = storm_index(shared_data)
    assert len(index) == 31
    searx = FakeSearxng(free_port(), index).start()
    backend = SearxngBackend(searx.base_url)
    trimmed = results = 0
    try:
        for query, hits in index.items():
            out = await web_search(query, backend=backend, max_results=10)
            assert [(r["title"], r["url"], r["content"]) for r in out["value"]] == \
                [(h["title"], h["url"], h["content"]) for h in hits]
            served, _, store = through_both_lanes("web_search", out)
            for before, after in zip(out["value"], served["output"]["value"], strict=True):
                if after["content"] != before["content"]:
                    trimmed += 1
                    assert store.texts[sha256_hex(before["content"])] == before["content"]
            results += len(out["value"])
    finally:
        await backend.aclose()
        searx.stop()
    print(f"STORM: {len(index)} queries, {results} results, {trimmed} contents trimmed in flight")
    assert results >= 90 and trimmed >= 1
