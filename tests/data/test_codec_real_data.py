"""The codec on real third-party material in ../shared/data (skips cleanly when absent; nothing is copied here).

- trajectories' tool outputs (SWE-agent, mini-SWE-agent full raw outputs, tau-bench, a Claude Code transcript)
  through both lanes as opaque outputs;
- the STORM web-research run's search results as `web_search` entities;
- FreshWiki articles and the article-extraction benchmark's pages as `web_fetch` results.

Every citation skeleton stays intact ({id, url, title} unchanged, in order, in the prompt and in the stored
envelope) and every trimmed text is recoverable byte for byte: from the blobs the lanes asked to write, through
``inflate``, and the stored envelope renders to exactly the in-flight bytes.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from ctxbuild_codec import (
    deflate,
    extract_text,
    inflight_threshold,
    persist_threshold,
    plan_inflight,
    sha256_hex,
    trim_inflight,
    trim_persist,
)
from ctxbuild_codec.codecs import get_at
from ctxbuild_codec.envelopes import blob_refs, inflate, render

from tests.support.realdata import freshwiki_text

pytestmark = pytest.mark.shared_data

THRESHOLD = inflight_threshold(30_000, 16_000)  # 4,800: a 16k-token window, as small models have
assert THRESHOLD == 4_800 and persist_threshold(THRESHOLD) == THRESHOLD


class Store:
    """A blob store stand-in: keeps every text the lanes ask to write, acknowledges its URI."""

    def __init__(self) -> None:
        self.texts: dict[str, str] = {}

    def __call__(self, blob) -> str:
        assert sha256_hex(blob.text) == blob.sha256
        self.texts[blob.sha256] = blob.text
        return blob.uri


def part(name: str, output: dict[str, Any], call_id: str = "call-1") -> dict[str, Any]:
    return {"type": "tool-result", "toolCallId": call_id, "toolName": name, "output": output}


def ids(n: int, rng: random.Random) -> list[str]:
    """Entity ids as the web tools make them: `<8 random chars>-<n>`, fresh per call."""
    prefix = "".join(rng.choices(string.ascii_letters + string.digits, k=8))
    return [f"{prefix}-{i + 1}" for i in range(n)]


def check_both_lanes(p: dict[str, Any]) -> tuple[bool, bool]:
    """Run a part through both lanes and check every guarantee; returns (trimmed in flight, persisted)."""
    store = Store()
    inflight = trim_inflight(p, THRESHOLD, store)
    stored = trim_persist(p, THRESHOLD, store)
    out = p["output"]
    if out["type"] == "json" and (d := deflate("entities", out["value"])) is not None and p["toolName"].startswith(
            ("web_", "kb_")):
        skeleton = [(r["id"], r["url"], r["title"]) for r in out["value"]]
        assert [(r["id"], r["url"], r["title"]) for r in inflight["output"]["value"]] == skeleton
        if stored["output"]["type"] == "persisted":
            env_skeleton = stored["output"]["value"]["skeleton"]
            assert [(r["id"], r["url"], r["title"]) for r in env_skeleton] == skeleton
        for b in d.blobs:  # each trimmed entity's full text is in the store under the URI its marker shows
            shown = get_at(inflight["output"]["value"], b.key)
            if shown != b.text:
                assert f"Full output: context://vfs/vfs_{sha256_hex(b.text)[:16]}.txt" in shown
                assert store.texts[sha256_hex(b.text)] == b.text
    elif "offload" in inflight:
        assert inflight["offload"]["mode"] == "offloaded"
        assert store.texts[inflight["offload"]["sha256"]] is not None
    if stored["output"]["type"] == "persisted":
        env = stored["output"]["value"]
        for ref in blob_refs(env):
            assert ref["fileEntryId"] in store.texts
        assert orjson.dumps(inflate(env, store.texts)) == orjson.dumps(out)  # byte-exact read-back
        assert orjson.dumps(render(env)) == orjson.dumps(inflight["output"])  # what the model saw in flight
        assert json.dumps(render(env), ensure_ascii=False) == json.dumps(inflight["output"], ensure_ascii=False)
    return "offload" in inflight, stored["output"]["type"] == "persisted"


# ---------- trajectories ----------

def trajectory_outputs(root: Path) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(source, tool name, output) for every tool result in the trajectories."""
    t = root / "trajectories"
    swe = json.loads((t / "01_sweagent_marshmallow-1867_function_calling.traj").read_text())
    for m in swe["history"]:
        if m["role"] == "tool":
            yield "sweagent", "mcp__shell__bash_0123", {"type": "text", "value": m["content"]}
    mini = json.loads((t / "03_miniswe_deepseek-chat_sqlfluff-1733.traj.json").read_text())
    for m in mini["messages"]:
        if m["role"] == "tool":  # the FULL output (the harness showed the model a cut of it)
            yield "miniswe", "mcp__shell__bash_0123", {"type": "text", "value": m["extra"]["raw_output"]}
    for episode in json.loads((t / "05_taubench_gpt-4o-airline_subset.json").read_text()):
        for m in episode["traj"]:
            if m["role"] == "tool":
                try:
                    value = json.loads(m["content"])
                    output = {"type": "json", "value": value}
                except ValueError:
                    output = {"type": "text", "value": m["content"]}
                yield "taubench", f"mcp__airline__{m.get('name', 'tool')}_0123", output
    for line in (t / "07_claudecode_transcript_with_compaction.jsonl").read_text().splitlines():
        content = (json.loads(line).get("message") or {}).get("content")
        for block in content if isinstance(content, list) else []:
            if block.get("type") == "tool_result":
                c = block["content"]
                blocks = c if isinstance(c, list) else [{"type": "text", "text": c}]
                if block.get("is_error"):
                    yield "claudecode", "mcp__cc__tool_0123", {"type": "error-text", "value": "\n".join(
                        b.get("text", "") for b in blocks)}
                else:
                    yield "claudecode", "mcp__cc__tool_0123", {"type": "content", "value": blocks}


def test_trajectory_tool_outputs(shared_data):
    seen: dict[str, int] = {}
    trimmed = persisted = big = big_unstructured = 0
    for source, name, output in trajectory_outputs(shared_data):
        seen[source] = seen.get(source, 0) + 1
        t, s = check_both_lanes(part(name, output))
        trimmed += t
        persisted += s
        n = len(extract_text(output))
        big += n > THRESHOLD
        big_unstructured += n > THRESHOLD and output["type"] in ("text", "content")
    assert seen == {"sweagent": 11, "miniswe": 79, "taubench": 74, "claudecode": 10}
    # every output over the threshold is trimmed in flight; at persist time structured outputs without a codec
    # (tau-bench's JSON) and errors stay whole
    assert trimmed == big >= 10 and persisted == big_unstructured >= 5
    # mini-SWE's biggest raw output: 110,817 chars → one marker, recoverable from its blob
    mini = [o for s, _, o in trajectory_outputs(shared_data) if s == "miniswe"]
    biggest = max(mini, key=lambda o: len(o["value"]))
    assert len(biggest["value"]) == 110_817
    assert len(trim_inflight(part("mcp__shell__bash_0123", biggest), THRESHOLD, Store())["output"]["value"]) < 2_000


def test_trajectory_outputs_as_read_tool_echoes(shared_data):
    """fs_read echoes: untouched in flight (it must not truncate its own read-back), offloaded at persist."""
    mini = [o for s, _, o in trajectory_outputs(shared_data) if s == "miniswe" and len(o["value"]) > THRESHOLD]
    assert mini
    for o in mini:
        echo = part("fs_read", {"type": "json", "value": {"kind": "text", "text": o["value"], "startLine": 1}})
        assert plan_inflight(echo, THRESHOLD) is None
        store = Store()
        stored = trim_persist(echo, THRESHOLD, store)
        assert stored["output"]["value"]["blobRefs"][0]["key"] == "/text"
        assert orjson.dumps(inflate(stored["output"]["value"], store.texts)) == orjson.dumps(echo["output"])


# ---------- STORM web search results as entities ----------

def storm_searches(root: Path) -> Iterator[list[dict[str, Any]]]:
    log = json.loads((root / "trajectories" / "06_storm_websearch_CRW_telesystem" / "conversation_log.json")
                     .read_text())
    rng = random.Random(6)
    for perspective in log:
        for turn in perspective["dlg_turns"]:
            results = turn["search_results"]
            yield [{"id": i, "title": r["title"], "url": r["url"], "content": "\n".join(r["snippets"]),
                    "description": r["description"]} for i, r in zip(ids(len(results), rng), results, strict=True)]


def test_storm_search_results_as_web_search_entities(shared_data):
    outputs = list(storm_searches(shared_data))
    assert len(outputs) == 12 and sum(len(o) for o in outputs) == 108
    trimmed = 0
    for i, value in enumerate(outputs):
        t, _ = check_both_lanes(part("web_search", {"type": "json", "value": value}, f"call-{i}"))
        trimmed += t
    assert trimmed >= 1  # a few pages' snippets exceed the threshold
    # all results of the run in one search: every entity over the threshold is cut, no citation is lost
    everything = [r for o in outputs for r in o]
    check_both_lanes(part("web_search", {"type": "json", "value": everything}))


# ---------- web pages as web_fetch results ----------

def test_freshwiki_pages_as_web_fetch_results(shared_data):
    pages = sorted((shared_data / "web" / "freshwiki").glob("*.json"))
    assert len(pages) == 3
    rng = random.Random(7)
    fetched = []
    for path, id_ in zip(pages, ids(len(pages), rng), strict=True):
        doc = json.loads(path.read_text())
        text = doc["summary"] + "\n\n" + freshwiki_text(doc["content"])
        fetched.append({"id": id_, "title": doc["title"], "url": doc["url"], "content": text})
        assert check_both_lanes(part("web_fetch", {"type": "json", "value": [fetched[-1]]})) == (True, True)
    assert check_both_lanes(part("web_fetch", {"type": "json", "value": fetched})) == (True, True)


def test_article_benchmark_pages_as_web_fetch_results(shared_data):
    bench = json.loads((shared_data / "web" / "article-extraction-benchmark_ground-truth.json").read_text())
    assert len(bench) == 181
    rng = random.Random(8)
    items = [{"id": id_, "title": key[:12], "url": page["url"], "content": page["articleBody"]}
             for id_, (key, page) in zip(ids(len(bench), rng), sorted(bench.items()), strict=True)]
    for start in range(0, len(items), 20):  # fetches of up to 20 pages each
        check_both_lanes(part("web_fetch", {"type": "json", "value": items[start:start + 20]}, f"call-{start}"))
