"""Finding #7 on real material, through the running services (blob store, truncation, persistence):
web_search / web_fetch results are trimmed per entity, and every ``{id, url, title}`` reaches the model and the
database unchanged.

- the STORM web-research run (../shared/data/trajectories/06_storm_websearch_CRW_telesystem/): its 12 searches
  (108 results, snippets joined as the content) as ``web_search`` outputs, then all 108 in one search;
- the FreshWiki articles (../shared/data/web/freshwiki/) as ``web_fetch`` results, one page per fetch and all
  three in one fetch.

Each step goes through ``ctx.truncate.step``; the turn is stored with ``ctx.persist.complete_turn`` (the in-flight
parts, as the runner sends them) and, in a second conversation, with the outputs in full (the persist lane's own
envelopes). Checked: citations unchanged and in order in the served output, in ``ctx.persist.history`` and in the
event row in Postgres; each trimmed entity shows exactly the codec's marker and its full text is readable from the
blob store; the envelopes render to the in-flight bytes. Skips cleanly when ../shared/data is absent.
"""

from __future__ import annotations

import json
import random
import string
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from ctxbuild_blobclient import BlobClient, content_ref
from ctxbuild_codec import envelopes, inflight_threshold, marker, sha256_hex
from ctxbuild_codec.lanes import entity_blobs_to_trim

from tests.support.realdata import REAL_DATA_SERVICES, freshwiki_text, services_fixture, start_conversation

pytestmark = REAL_DATA_SERVICES

STORM = "trajectories/06_storm_websearch_CRW_telesystem/conversation_log.json"


services = services_fixture("blobstore", "truncation", "persistence")


def ids(n: int, rng: random.Random) -> list[str]:
    """Entity ids as the web tools make them: `<8 random chars>-<n>`, fresh per call."""
    prefix = "".join(rng.choices(string.ascii_letters + string.digits, k=8))
    return [f"{prefix}-{i + 1}" for i in range(n)]


def storm_searches(root: Path) -> list[list[dict[str, Any]]]:
    path = root / STORM
    if not path.exists():
        pytest.skip(f"{path} absent")
    rng = random.Random(6)
    out = []
    for perspective in json.loads(path.read_text()):
        for turn in perspective["dlg_turns"]:
            results = turn["search_results"]
            out.append([{"id": i, "title": r["title"], "url": r["url"], "content": "\n".join(r["snippets"]),
                         "description": r["description"]}
                        for i, r in zip(ids(len(results), rng), results, strict=True)])
    return out


def freshwiki_pages(root: Path) -> list[dict[str, Any]]:
    pages = sorted((root / "web" / "freshwiki").glob("*.json"))
    if not pages:
        pytest.skip("no FreshWiki pages in ../shared/data/web/freshwiki")
    rng = random.Random(7)
    out = []
    for path, id_ in zip(pages, ids(len(pages), rng), strict=True):
        doc = json.loads(path.read_text())
        out.append({"id": id_, "title": doc["title"], "url": doc["url"],
                    "content": doc["summary"] + "\n\n" + freshwiki_text(doc["content"])})
    return out


def citations(items: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    return [(e["id"], e["url"], e["title"]) for e in items]


def wire_bytes(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


async def open_conversation(rpc, user_id: str) -> str:
    return await start_conversation(rpc, f"conv-real-{uuid.uuid4().hex}", user_id, "research")


async def run_turn(rpc, stack, tool: str, outputs: list[list[dict[str, Any]]], window: int) -> dict[str, int]:
    """Every output as one step of one turn; then the turn stored both ways; everything checked."""
    threshold = inflight_threshold(None, window)
    prefix = uuid.uuid4().hex[:12]
    cid = await open_conversation(rpc, f"{prefix}-u")
    turn = f"turn-{prefix}"
    raw_parts = [{"type": "tool-result", "toolCallId": f"call-{i}", "toolName": tool,
                  "output": {"type": "json", "value": value}} for i, value in enumerate(outputs)]
    served: list[dict[str, Any]] = []
    blobs = BlobClient(rpc)
    trimmed = 0
    for part in raw_parts:  # one step per tool call, as the runner does
        reply = await rpc.call("ctx.truncate.step", {"conversationId": cid, "turnId": turn,
                                                     "settings": {"contextWindow": window}, "parts": [part]})
        assert reply["threshold"] == threshold
        out = reply["parts"][0]
        value, shown = part["output"]["value"], out["output"]["value"]
        # the model sees every citation unchanged, in order, next to each entity's (maybe trimmed) content
        assert out["output"]["type"] == "json" and citations(shown) == citations(value)
        assert [{k: v for k, v in e.items() if k != "content"} for e in shown] == \
            [{k: v for k, v in e.items() if k != "content"} for e in value]
        rows = {b["key"]: b for b in (out.get("offload") or {}).get("blobs", [])}
        # the codec's rule: every entity over the threshold, then the longest others while the output is still
        # over it together (unit-tested in test_codec_lanes); here: what it picks is what the service trimmed
        to_trim = {k for k, _ in entity_blobs_to_trim([(f"/{i}/content", e["content"]) for i, e in enumerate(value)],
                                                     threshold)}
        for i, (orig, got) in enumerate(zip(value, shown, strict=True)):
            content = orig["content"]
            if len(content) > threshold and len(content) > 1_500:
                assert f"/{i}/content" in to_trim  # the per-entity rule of SPEC §5.2 still holds
            if f"/{i}/content" in to_trim:
                assert got["content"] == marker(content)
                row = rows[f"/{i}/content"]
                assert row["sha256"] == sha256_hex(content)
                assert await blobs.get_text(cid, sha256=row["sha256"]) == content  # readable in full
                trimmed += 1
            else:
                assert got["content"] == content and f"/{i}/content" not in rows
        served.append(out)

    calls = [{"type": "tool-call", "toolCallId": p["toolCallId"], "toolName": tool, "input": {}} for p in raw_parts]

    async def store(parts: list[dict[str, Any]], conversation: str, tag: str) -> list[dict[str, Any]]:
        messages = [{"id": f"{tag}-a", "role": "assistant", "parentId": f"{prefix}-u", "parts": calls},
                    {"id": f"{tag}-t", "role": "tool", "parts": parts}]
        event_id = str(uuid.uuid4())
        await rpc.call("ctx.persist.complete_turn", {
            "conversationId": conversation, "turnId": turn, "eventId": event_id, "messages": messages,
            "settings": {"truncateThreshold": threshold}}, timeout=120)
        h = await rpc.call("ctx.persist.history", {"conversationId": conversation})
        stored = next(m for m in h["messages"] if m["id"] == f"{tag}-t")["parts"]
        conn = await asyncpg.connect(stack.env["CTX_DATABASE_URL"])
        try:  # a large turn spreads over several small events; large parts travel by content reference
            rows = await conn.fetch("SELECT data::text AS data FROM persistence.events WHERE stream_id = $1 "
                                    "AND type = 'AssistantMessageCompleted'", f"conversation:{conversation}")
        finally:
            await conn.close()
        row = next(m for r in rows for m in json.loads(r["data"])["messages"] if m["id"] == f"{tag}-t")
        if content_ref.is_ref(row["parts"]):
            row = await content_ref.resolve_message(blobs, row, conversation)
        assert row["parts"] == stored  # the projection serves exactly the event's content
        return stored

    # 1. the runner's way: the in-flight parts are stored as served
    stored = await store(served, cid, f"{prefix}-1")
    for part, out, raw in zip(stored, served, raw_parts, strict=True):
        assert wire_bytes(envelopes.render_part(part)["output"]) == wire_bytes(out["output"])
        assert citations(part["output"]["value"]) == citations(raw["output"]["value"])

    # 2. the outputs in full: the persist lane's envelopes keep the citations and render to the in-flight bytes
    cid2 = await open_conversation(rpc, f"{prefix}-u")
    stored = await store(raw_parts, cid2, f"{prefix}-2")
    for part, out, raw in zip(stored, served, raw_parts, strict=True):
        output = part["output"]
        if output["type"] == "persisted":
            assert citations(output["value"]["skeleton"]) == citations(raw["output"]["value"])
            assert wire_bytes(envelopes.render(output["value"])) == wire_bytes(out["output"])
        else:
            assert output == raw["output"] == out["output"]  # nothing over the threshold: stored and served whole
    return {"outputs": len(outputs), "entities": sum(len(v) for v in outputs), "trimmed": trimmed}


@pytest.mark.parametrize("window", [16_000, 4_000], ids=["W16k-4800", "W4k-2000"])
async def test_storm_search_results_trimmed_per_entity(shared_data, services, rpc, stack, window):
    searches = storm_searches(shared_data)
    assert len(searches) == 12 and sum(len(s) for s in searches) == 108
    everything = [e for s in searches for e in s]
    figures = await run_turn(rpc, stack, "web_search", [*searches, everything], window)
    assert figures["entities"] == 216
    assert figures["trimmed"] >= (2 if window == 16_000 else 20), figures
    print(f"\nSTORM W={window}: {figures}")


async def test_freshwiki_pages_as_web_fetch_results(shared_data, services, rpc, stack):
    pages = freshwiki_pages(shared_data)
    assert len(pages) == 3 and all(len(p["content"]) > 10_000 for p in pages)
    figures = await run_turn(rpc, stack, "web_fetch", [[p] for p in pages] + [pages], 16_000)
    assert figures["trimmed"] == 6, figures  # every page, alone and in the three-page fetch
