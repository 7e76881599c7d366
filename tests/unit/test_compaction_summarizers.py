"""The three summarizers behind one interface (SPEC §10): llm (flatten, budgets, stubbing, clamp,
post-processing, through the provider adapters), extractive (sumy, offline), masking (markers, restorable)."""

from __future__ import annotations

import pytest
from ctxbuild_codec import (
    marker,
    render_marker,
    sha256_hex,
    summarizer_budgets,
    trim_inflight,
    trim_persist,
    vfs_uri,
)
from ctxbuild_codec.envelopes import render
from ctxbuild_compaction.app import ExtractiveSummarizer, LlmSummarizer, MaskingSummarizer, fold_with_fallback
from ctxbuild_compaction.domain import (
    Checkpoint,
    FoldRequest,
    InLoopSettings,
    RegexTokenizer,
    apply_masking,
    build_input,
    extractive_summary,
    finish_in_loop,
    flatten,
    plan_in_loop,
    plan_masking,
    postprocess,
    rank,
)
from ctxbuild_compaction.domain.llm_input import INSTRUCTION, PREVIOUS
from ctxbuild_providers import ModelResponse, ProviderError, ReplayProvider


def tool_pair(i, text, name="read_file", **extra):
    return [{"id": f"a{i}", "role": "assistant", "turnId": "t",
             "parts": [{"type": "tool-call", "toolCallId": f"c{i}", "toolName": name, "input": {"page": i}}]},
            {"id": f"t{i}", "role": "tool", "turnId": "t",
             "parts": [{"type": "tool-result", "toolCallId": f"c{i}", "toolName": name,
                        "output": {"type": "text", "value": text}, **extra}]}]


class RecordingProvider:
    name = "openai"

    def __init__(self, answer="<analysis>thinking</analysis>\n<summary>\nS1\n\n\n\nS2\n</summary>", fail=False):
        self.requests = []
        self.answer = answer
        self.fail = fail

    async def complete(self, request):
        self.requests.append(request)
        if self.fail:
            raise ProviderError("HTTP 503", retryable=True)
        return ModelResponse([{"type": "text", "text": self.answer}], {"inputTokens": 1234, "outputTokens": 56},
                             "stop")


# ---------- llm: flatten, budgets, stubbing, clamp, post-processing ----------

def test_flatten_vector():
    rows = [{"id": "s", "role": "system", "parts": [{"type": "text", "text": "be brief"}]},
            {"id": "u", "role": "user", "parts": [
                {"type": "text", "text": "look"},
                {"type": "file", "handle": "a.png", "displayName": "a.png", "mediaType": "image/png",
                 "sha256": "a" * 64},
                {"type": "file", "handle": "r.pdf", "displayName": "r.pdf", "mediaType": "application/pdf",
                 "sha256": "b" * 64},
                {"type": "file", "handle": "", "displayName": "", "mediaType": "text/plain", "sha256": "c" * 64}]},
            *tool_pair(1, "page one")]
    lines = flatten(rows)
    assert [(ln.role, ln.text) for ln in lines[:2]] == [
        ("user", "look\n[image: a.png]\n[document: r.pdf]\n[attachment]"),
        ("assistant", '[Called tool: read_file({"page":1})]')]
    assert lines[2].role == "user" and lines[2].tool_id == "c1" and lines[2].tool_text == "page one"
    built = build_input("the previous summary", rows, 100_000)
    texts = [(m["role"], m["parts"][0]["text"]) for m in built.messages]
    assert texts == [("user", PREVIOUS.format(summary="the previous summary")),
                     ("user", "look\n[image: a.png]\n[document: r.pdf]\n[attachment]"),
                     ("assistant", '[Called tool: read_file({"page":1})]'),
                     ("user", "[Tool result (c1): page one]"),
                     ("user", INSTRUCTION)]
    assert built.stub is None and built.omitted == 0
    assert "<analysis>" in INSTRUCTION and "<summary>" in INSTRUCTION


@pytest.mark.parametrize("budget, level", [(9_000, 4000), (1_500, 1000), (700, 200), (400, 0)])
def test_stubbing_levels(budget, level):
    rows = [m for i in range(1, 4) for m in tool_pair(i, f"line {i}\n" + "token " * 3_000)]
    built = build_input(None, rows, budget)
    assert built.stub == level and built.omitted == 0 and built.tokens <= budget
    results = [m["parts"][0]["text"] for m in built.messages if m["parts"][0]["text"].startswith("[Tool result")]
    assert len(results) == 3
    # the codec's inline excerpt: first N chars + "--- truncated (L lines, C chars total) ---"
    assert all("--- truncated (2 lines, 18007 chars total) ---" in r for r in results)
    assert results[0].startswith(f"[Tool result (c1): {('line 1' + chr(10) + 'token ' * 3_000)[:level]}".rstrip())


def test_clamp_keeps_the_first_message_and_the_newest_that_fit():
    rows = [{"id": f"u{i}", "role": "user", "parts": [{"type": "text", "text": f"message {i} " + "word " * 200}]}
            for i in range(40)]
    built = build_input("prev", rows, 2_000)
    texts = [m["parts"][0]["text"] for m in built.messages]
    assert texts[0] == PREVIOUS.format(summary="prev")
    assert texts[1] == f"[{built.omitted} earlier messages omitted — the summary must rely on the rest]"
    assert texts[-1] == INSTRUCTION and texts[-2].startswith("message 39 ")
    kept = [int(t.split()[1]) for t in texts[2:-1]]
    assert kept == list(range(40 - len(kept), 40)) and built.omitted == 40 - len(kept)
    assert built.tokens <= 2_000 and built.stub == 0


def test_postprocess_vectors():
    assert postprocess("<analysis>x\ny</analysis>\n<summary>\nA\n\n\n\nB\n</summary>\n") == "A\n\nB"
    assert postprocess("no tags\n\n\n\nat all  ") == "no tags\n\nat all"
    assert postprocess("<analysis>cut off before the summary") == ""
    assert postprocess("<summary>unterminated\n\n\nsummary") == "unterminated\n\nsummary"


async def test_llm_summarizer_goes_through_a_provider_with_the_budgets():
    provider = RecordingProvider()
    s = LlmSummarizer(provider, "small-model", window=None, chat_window=16_000)
    fold = FoldRequest("earlier summary", [m for i in (1, 2) for m in tool_pair(i, "x" * 50)], 4_000)
    outcome = await s.fold(fold)
    assert outcome.summary == "S1\n\nS2" and outcome.calls == 1 and outcome.input_tokens == 1234
    (req,) = provider.requests
    out_budget, in_budget = summarizer_budgets(None, 16_000)
    assert (out_budget, in_budget) == (4096, 10118)
    assert req.model == "small-model" and req.max_output_tokens == 4096 and req.tools == []
    assert outcome.detail["inputBudget"] == in_budget
    assert req.messages[0]["parts"][0]["text"] == PREVIOUS.format(summary="earlier summary")


async def test_llm_summarizer_on_the_replay_adapter():
    replay = ReplayProvider([{"text": "<analysis>a</analysis><summary>The user asked for pages 1-2.</summary>"}])
    outcome = await LlmSummarizer(replay, "replay").fold(FoldRequest(None, tool_pair(1, "p"), 4_000))
    assert outcome.summary == "The user asked for pages 1-2." and outcome.input_tokens > 0


async def test_llm_failure_falls_back_to_masking_with_the_error():
    rows = tool_pair(1, "y" * 3_000)
    fold = FoldRequest(None, rows, 4_000, conversation_id="conv", turn_id="turn")

    async def put(text, cid, tid):
        return vfs_uri(sha256_hex(text))

    out = await fold_with_fallback(LlmSummarizer(RecordingProvider(fail=True), "m"), fold, MaskingSummarizer(put))
    assert out.summarizer == "masking" and out.fallback_from == "llm" and "HTTP 503" in out.error
    masked = render_marker("", "", 1, 3_000, vfs_uri(sha256_hex("y" * 3_000)))
    assert out.rows[1]["parts"][0]["output"]["value"] == masked
    empty = await fold_with_fallback(LlmSummarizer(RecordingProvider(answer="<analysis>only</analysis>"), "m"), fold,
                                     MaskingSummarizer(put))
    assert empty.summarizer == "masking" and empty.error == "empty summary"


async def test_second_llm_fold_gets_the_first_fold_plus_the_increment():
    """Finding #4 at the summarizer: the second in-loop call's input is [first fold, +new], not the history."""
    provider = RecordingProvider(answer="<summary>FIRST FOLD</summary>")
    s = LlmSummarizer(provider, "m", chat_window=8_000)
    rows = [{"id": "u1", "role": "user", "parts": [{"type": "text", "text": "read it all"}]}]
    ck = Checkpoint()
    for i in range(1, 25):
        rows += tool_pair(i, f"page {i} " + "data " * 700)
        plan = plan_in_loop(rows, 0, ck, InLoopSettings(8_000), turn_id="t")
        if plan.fold is not None:
            plan, _ = finish_in_loop(plan, await s.fold(plan.fold))
            provider.answer = f"<summary>FOLD {len(provider.requests) + 1}</summary>"
        ck = plan.checkpoint
    assert len(provider.requests) >= 2
    first, second = provider.requests[0], provider.requests[1]
    seen_first = {m["parts"][0]["text"] for m in first.messages}
    texts = [m["parts"][0]["text"] for m in second.messages]
    assert texts[0] == PREVIOUS.format(summary="FIRST FOLD")
    assert not any(t in seen_first for t in texts[1:-1])      # nothing the first fold already summarized
    assert "read it all" not in " ".join(texts)               # the history before the first fold is not resent
    assert texts[-1] == INSTRUCTION


# ---------- extractive (sumy, offline) ----------

def test_extractive_runs_offline_on_sumy_with_a_regex_tokenizer():
    from ctxbuild_compaction.domain.extractive import TextRank
    from sumy.summarizers.text_rank import TextRankSummarizer
    assert issubclass(TextRank, TextRankSummarizer)  # the library doing the ranking
    tok = RegexTokenizer()
    assert tok.to_sentences("First one. Second one!\nThird line") == ("First one.", "Second one!", "Third line")
    assert tok.to_words("don't stop-words 42 x") == ("don't", "stop-words", "x")
    sentences = ["The sensor temperature exceeded the threshold on rack B7.",
                 "Lunch was good.",
                 "The temperature threshold of the sensor on rack B7 is 20 degrees.",
                 "The sensor on rack B7 reported a temperature of 21.1 degrees."]
    assert rank(sentences)[-1] == 1  # the off-topic sentence is least central


def test_extractive_keeps_the_central_sentences_of_each_row():
    text = ("I need help with the billing report. The billing report for March shows a duplicate invoice. "
            "My cat is asleep. Please find the duplicate invoice in the billing report.")
    rows = [{"id": "u1", "role": "user", "parts": [{"type": "text", "text": text}]}]
    out = extractive_summary(None, rows, 4_000)
    assert out.startswith("Earlier messages:\n- User: ")
    assert "billing report" in out and len(out.splitlines()[1]) <= 300 + 10
    assert extractive_summary(None, rows, 4_000) == out  # deterministic


def test_extractive_pairs_each_call_with_its_own_result_when_ids_repeat():
    """Two turns both calling call_1_1: each call line names its own turn's result, not the later one."""
    rows = []
    for k, value in enumerate(["x" * 120, "y" * 4_500]):
        rows += [{"id": f"u{k}", "role": "user", "parts": [{"type": "text", "text": f"turn {k}"}]},
                 {"id": f"a{k}", "role": "assistant", "parts": [
                     {"type": "tool-call", "toolCallId": "call_1_1", "toolName": "bash", "input": {"n": k}}]},
                 {"id": f"t{k}", "role": "tool", "parts": [{"type": "tool-result", "toolCallId": "call_1_1",
                                                            "toolName": "bash",
                                                            "output": {"type": "text", "value": value}}]}]
    out = extractive_summary(None, rows, 4_000)
    calls = [ln for ln in out.splitlines() if "[called:" in ln]
    assert len(calls) == 2 and "→ 120 chars" in calls[0] and "→ 4,500 chars" in calls[1], calls


async def test_extractive_summarizer_interface():
    out = await ExtractiveSummarizer().fold(FoldRequest("prev", tool_pair(1, "z"), 2_000))
    assert out.summarizer == "extractive" and out.calls == 0 and out.summary.startswith(
        "Summary of the conversation before that:\nprev\n\nEarlier messages:\n- Assistant: [called: read_file(page=1)")


# ---------- masking ----------

def test_masking_offloaded_outputs_become_their_markers_restorably():
    page = "\n".join(f"line {i}" for i in range(2_000))
    uri = vfs_uri(sha256_hex(page))
    part = trim_inflight({"type": "tool-result", "toolCallId": "c1", "toolName": "read_file",
                          "output": {"type": "text", "value": page}}, 4_800, lambda b: vfs_uri(b.sha256))
    assert part["output"]["value"] == marker(page) and part["offload"]["uri"] == uri
    rows = [tool_pair(1, "")[0], {"id": "t1", "role": "tool", "parts": [part]}]
    assert plan_masking(rows) == []   # already archived: nothing to put
    masked = apply_masking(rows, {})
    out = masked[1]["parts"][0]
    assert out["output"] == {"type": "text", "value": render_marker("", "", 2_000, len(page), uri)}
    assert out["offload"] == part["offload"] and masked[0] is rows[0]   # the blob stays readable by its URI
    assert apply_masking(masked, {}) == masked                         # idempotent bytes


def test_masking_persisted_envelopes_and_unarchived_outputs():
    text = "".join(f"result line {i}\n" for i in range(300))
    stored = trim_persist({"type": "tool-result", "toolCallId": "c1", "toolName": "web_fetch",
                           "output": {"type": "text", "value": text}}, 2_000, lambda b: vfs_uri(b.sha256))
    env = stored["output"]["value"]
    rows = [{"id": "t1", "role": "tool", "parts": [stored]},
            {"id": "t2", "role": "tool", "parts": [{"type": "tool-result", "toolCallId": "c2", "toolName": "x",
                                                    "output": {"type": "json", "value": {"rows": ["v" * 2_000]}}}]},
            {"id": "t3", "role": "tool", "parts": [{"type": "tool-result", "toolCallId": "c3", "toolName": "x",
                                                    "output": {"type": "error-text", "value": "e" * 5_000}}]},
            {"id": "t4", "role": "tool", "parts": [{"type": "tool-result", "toolCallId": "c4", "toolName": "x",
                                                    "output": {"type": "text", "value": "small"}}]}]
    todo = plan_masking(rows)
    assert len(todo) == 1 and todo[0].text.startswith('{"rows":["vvv')
    masked = apply_masking(rows, {todo[0].sha256: vfs_uri(todo[0].sha256)})
    v1 = masked[0]["parts"][0]
    assert v1["output"] == render({**env, "head": "", "tail": ""})
    assert "preview omitted" in v1["output"]["value"] and v1["offload"]["mode"] == "offloaded"
    assert masked[1]["parts"][0]["offload"]["uri"] == vfs_uri(todo[0].sha256)
    assert masked[2] is rows[2] and masked[3] is rows[3]   # errors and small outputs stay
    # a failed put keeps the output whole ("better fat than lost")
    assert apply_masking(rows, {todo[0].sha256: None})[1] is rows[1]
