"""Property tests (hypothesis) for the codec: exact recovery, idempotence, identity fields, determinism, and
persist-rendered == in-flight bytes for the same input."""

from __future__ import annotations

import json

import orjson
from ctxbuild_codec import (
    assemble,
    deflate,
    inflate_value,
    nontext,
    plan_inflight,
    sha256_hex,
    trim_inflight,
    trim_persist,
)
from ctxbuild_codec.codecs import content_texts
from ctxbuild_codec.envelopes import inflate, parse, render
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PROPS = settings(max_examples=120, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# threshold as the in-flight lane computes it: never below 2,000
thresholds = st.integers(min_value=2_000, max_value=6_000)


@st.composite
def texts(draw) -> str:
    """Texts from empty to ~12k chars: a random chunk (with or without a newline) repeated to a drawn size
    around the thresholds, with random ends — so most examples really are trimmed."""
    chunk = draw(st.text(min_size=1, max_size=120))
    if draw(st.booleans()):
        chunk += "\n"
    target = draw(st.sampled_from([0, 900, 1_600, 2_100, 2_600, 4_000, 7_000, 12_000]))
    reps = target // len(chunk) + draw(st.integers(min_value=0, max_value=3))
    return draw(st.text(max_size=40)) + chunk * reps + draw(st.text(max_size=40))


json_scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=20)
extra_fields = st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda k: k not in {"content"}),
                               json_scalars, max_size=3)


@st.composite
def web_results(draw) -> list[dict]:
    n = draw(st.integers(min_value=1, max_value=6))
    prefix = draw(st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789", min_size=8, max_size=8))
    items = []
    for i in range(n):
        fields = [("id", f"{prefix}-{i + 1}"), ("url", f"https://example.org/{draw(st.integers(0, 10**6))}"),
                  ("title", draw(st.text(max_size=30))), ("content", draw(texts()))]
        fields += [(k, v) for k, v in draw(extra_fields).items() if k not in {"id", "url", "title"}]
        order = draw(st.permutations(fields))  # any key order: it must survive byte for byte
        items.append(dict(order))
    return items


def tool_result(name: str, output: dict) -> dict:
    return {"type": "tool-result", "toolCallId": "call-1", "toolName": name, "output": output}


@st.composite
def parts(draw) -> dict:
    kind = draw(st.sampled_from(["text", "error-text", "json", "content", "web"]))
    if kind == "web":
        return tool_result(draw(st.sampled_from(["web_search", "web_fetch", "kb_search"])),
                           {"type": "json", "value": draw(web_results())})
    if kind == "json":
        return tool_result("mcp__db__query_0123", {"type": "json", "value": {"rows": draw(texts())}})
    if kind == "content":
        block = (st.builds(lambda t: {"type": "text", "text": t}, texts())
                 | st.just({"type": "text", "text": ""})
                 | st.just({"type": "image", "data": "QUJD", "mimeType": "image/png"})
                 | st.builds(lambda t: {"type": "text", "text": t, "annotations": {"priority": 1}}, texts()))
        output = {"type": "content", "value": draw(st.lists(block, min_size=1, max_size=4))}
        if draw(st.booleans()):
            output["metadata"] = {"server": draw(st.text(max_size=10))}
        return tool_result("mcp__srv__read_0123", output)
    return tool_result("mcp__shell__run_0123", {"type": kind, "value": draw(texts())})


def store(blob) -> str:
    return blob.uri


def blob_texts(part: dict) -> dict[str, str]:
    """fileEntryId → full text, for everything a part could have offloaded (what a blob store would return)."""
    out = part["output"]
    if out["type"] == "json" and (d := deflate("entities", out["value"])) is not None:
        candidates = [b.text for b in d.blobs]
    elif out["type"] == "content":
        candidates = ["\n".join(content_texts(out["value"])), nontext.original_text(out)]  # text, original
    else:
        candidates = [out["value"]] if isinstance(out["value"], str) else []
    return {sha256_hex(t): t for t in candidates}


# ---------- codecs ----------

@PROPS
@given(web_results())
def test_inflate_of_deflate_is_exact(value):
    d = deflate("entities", value)
    assert orjson.dumps(inflate_value(d.skeleton, d.blobs)) == orjson.dumps(value)
    page = {"kind": "text", **value[0]}
    page["text"] = value[0]["content"]
    d = deflate("text-field", page)
    assert json.dumps(inflate_value(d.skeleton, d.blobs)) == json.dumps(page)


@PROPS
@given(web_results(), st.lists(st.text(max_size=50), min_size=1, max_size=6))
def test_assemble_only_changes_the_keys_it_is_given(value, replacements):
    texts_ = {f"/{i}/content": r for i, r in enumerate(replacements) if i < len(value)}
    out = assemble(value, texts_)
    for i, item in enumerate(value):
        expected = dict(item)
        if f"/{i}/content" in texts_:
            expected["content"] = texts_[f"/{i}/content"]
        assert json.dumps(out[i]) == json.dumps(expected)


# ---------- lanes ----------

@PROPS
@given(parts(), thresholds)
def test_trim_is_idempotent(part, threshold):
    once = trim_inflight(part, threshold, store)
    assert trim_inflight(once, threshold, store) == once  # typed provenance: already offloaded
    # and content-level: a trimmed output, shown again without provenance, is small enough to be left alone
    bare = {k: v for k, v in once.items() if k != "offload"}
    if (once.get("offload") or {}).get("original", {}).get("of") != "output":
        # (an output with non-text parts shows their markers after the text: provenance alone guards it)
        assert plan_inflight(bare, threshold) is None


@PROPS
@given(web_results(), thresholds, st.booleans())
def test_identity_fields_never_change(value, threshold, inflight):
    part = tool_result("web_search", {"type": "json", "value": value})
    out = trim_inflight(part, threshold, store) if inflight else trim_persist(part, threshold, store)
    got = out["output"]["value"] if out["output"]["type"] == "json" else out["output"]["value"]["skeleton"]
    assert len(got) == len(value)
    for before, after in zip(value, got, strict=True):
        assert list(after) == list(before)
        assert {k: v for k, v in after.items() if k != "content"} == {k: v for k, v in before.items()
                                                                     if k != "content"}


@PROPS
@given(parts(), thresholds)
def test_persist_rendered_equals_inflight_bytes(part, threshold):
    inflight = trim_inflight(part, threshold, store)
    stored = trim_persist(part, threshold, store)
    if stored["output"]["type"] != "persisted":
        return  # left whole at persist time (errors, structured without codec, nothing above the threshold)
    rendered = render(stored["output"]["value"])
    assert json.dumps(rendered, ensure_ascii=False) == json.dumps(inflight["output"], ensure_ascii=False)
    assert orjson.dumps(rendered) == orjson.dumps(inflight["output"])


@PROPS
@given(parts(), thresholds)
def test_inflate_recovers_exactly_and_rendering_is_deterministic(part, threshold):
    stored = trim_persist(part, threshold, store)
    if stored["output"]["type"] != "persisted":
        assert stored is part
        return
    env = stored["output"]["value"]
    parse(env)
    assert orjson.dumps(inflate(env, blob_texts(part))) == orjson.dumps(part["output"])
    again = json.loads(json.dumps(env))  # as read back from the database
    assert orjson.dumps(render(again)) == orjson.dumps(render(env))
    assert orjson.dumps(trim_persist(part, threshold, store)) == orjson.dumps(stored)
