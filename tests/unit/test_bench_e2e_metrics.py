"""The end-to-end bench's metric functions (bench/e2e_metrics.py): pure logic on requests, events and messages."""

from __future__ import annotations

import json

import pytest

from bench.e2e_metrics import (
    check_citations,
    compaction_steps,
    duplicate_call_ids,
    entity_items,
    history_problems,
    orphan_count,
    orphans,
    percentile,
    prefix_extends,
    recorded_output,
    same_output,
    step_overheads,
    storm_turns,
    summary_ms,
    untrimmed_steps,
)


def call(cid: str, name: str = "bash") -> dict:
    return {"type": "tool-call", "toolCallId": cid, "toolName": name, "input": {}}


def result(cid: str, value="ok", name: str = "bash") -> dict:
    return {"type": "tool-result", "toolCallId": cid, "toolName": name, "output": {"type": "text", "value": value}}


def msg(role: str, *parts: dict, **extra) -> dict:
    return {"role": role, "parts": list(parts), **extra}


def request(messages: list[dict], system: str = "sys", tools: list | None = None) -> dict:
    return {"model": "replay", "system": system, "tools": tools or [{"name": "bash"}], "messages": messages}


# ---------------------------------------------------------------- prefix stability

def test_a_request_that_appends_messages_extends_the_previous_one():
    u = msg("user", {"type": "text", "text": "hi"})
    a, t = msg("assistant", call("c1")), msg("tool", result("c1"))
    assert prefix_extends(request([u]), request([u, a, t]))
    assert prefix_extends(request([u, a, t]), request([u, a, t]))  # equal is a (trivial) prefix


@pytest.mark.parametrize("change", ["system", "tools", "message", "shorter", "key order"])
def test_any_byte_change_before_the_new_messages_breaks_the_prefix(change):
    u = msg("user", {"type": "text", "text": "hi"})
    a, t = msg("assistant", call("c1")), msg("tool", result("c1"))
    prev = request([u, a, t])
    if change == "system":
        cur = request([u, a, t], system="sys2")
    elif change == "tools":
        cur = request([u, a, t], tools=[{"name": "bash", "description": "x"}])
    elif change == "message":
        cur = request([u, a, msg("tool", result("c1", "OK")), msg("assistant", {"type": "text", "text": "x"})])
    elif change == "shorter":
        cur = request([u, a])
    else:
        cur = request([{"parts": u["parts"], "role": "user"}, a, t])  # same content, other key order: other bytes
    assert not prefix_extends(prev, cur)


def test_compaction_steps_are_the_steps_of_in_loop_decisions_and_folds():
    events = [{"type": "CompactionDecided", "data": {"phase": "turn-start", "status": "skipped"}},
              {"type": "StepServed", "data": {"step": 1}},
              {"type": "InLoopFoldRecorded", "data": {"step": 3}},
              {"type": "CompactionDecided", "data": {"phase": "in-loop", "status": "done", "step": 3}},
              {"type": "CompactionDecided", "data": {"phase": "in-loop", "status": "skipped", "step": 5}}]
    assert compaction_steps(events) == {3, 5}


# ---------------------------------------------------------------- orphans

def test_no_orphans_when_every_call_is_answered_later():
    rows = [msg("user"), msg("assistant", call("a"), call("b")), msg("tool", result("a"), result("b"))]
    assert orphans(rows) == {"calls": [], "results": []}


def test_a_call_without_a_result_and_a_result_before_its_call_are_orphans():
    rows = [msg("tool", result("early")), msg("assistant", call("early"), call("lost"))]
    o = orphans(rows)
    assert o == {"calls": ["early", "lost"], "results": ["early"]}
    assert orphan_count(rows) == 3


def test_reused_call_ids_across_turns_pair_in_order():
    rows = [msg("assistant", call("call_1_1")), msg("tool", result("call_1_1")), msg("user"),
            msg("assistant", call("call_1_1")), msg("tool", result("call_1_1"))]
    assert orphan_count(rows) == 0
    assert duplicate_call_ids(rows) == ["call_1_1"]
    # a second result for the same call is an orphan even though the id is known
    assert orphans([*rows, msg("tool", result("call_1_1"))])["results"] == ["call_1_1"]


# ---------------------------------------------------------------- raw history

SCRIPT = [{"toolCalls": [{"toolName": "bash", "input": {}, "output": {"type": "text", "value": "FULL" * 1000}},
                         {"toolName": "bash", "input": {}}]},
          {"text": "done"}]


def test_recorded_output_maps_replay_call_ids_to_the_script():
    assert recorded_output(SCRIPT, "call_1_1") == {"type": "text", "value": "FULL" * 1000}
    assert recorded_output(SCRIPT, "call_1_2") is None  # recorded without an output: executed, not replayed
    assert recorded_output(SCRIPT, "call_3_1") is None
    assert recorded_output(SCRIPT, "call_x") is None
    assert recorded_output(SCRIPT, "toolu_123") is None


def test_untrimmed_steps_put_the_recorded_full_outputs_back():
    a1 = {"id": "a1", "role": "assistant", "parts": [call("call_1_1"), call("call_1_2")]}
    a2 = {"id": "a2", "role": "assistant", "parts": [{"type": "text", "text": "done"}]}
    trimmed = {"type": "text", "value": "FULL<persisted-output>…"}
    events = [
        {"type": "StepServed", "data": {"step": 1, "assistantMessage": a1}},
        {"type": "ToolResultRecorded", "data": {"step": 1, "toolCallId": "call_1_2", "toolName": "bash",
                                                "output": {"type": "text", "value": "ran"}}},
        {"type": "ToolResultRecorded", "data": {"step": 1, "toolCallId": "call_1_1", "toolName": "bash",
                                                "output": trimmed, "trimmed": True}},
        {"type": "StepServed", "data": {"step": 2, "assistantMessage": a2}},
    ]
    added = untrimmed_steps(events, SCRIPT)
    assert added[2] == [a2]
    assert added[1][0] == a1
    tool = added[1][1]
    assert [p["toolCallId"] for p in tool["parts"]] == ["call_1_1", "call_1_2"]  # call order, not record order
    assert tool["parts"][0]["output"]["value"] == "FULL" * 1000
    assert tool["parts"][1]["output"]["value"] == "ran"


# ---------------------------------------------------------------- pipeline overhead

def test_overhead_is_the_gap_between_steps_minus_model_time():
    def served(step, at, model_ms):
        return {"type": "StepServed", "recordedAt": at, "data": {"step": step, "modelMs": model_ms}}

    events = [served(1, "2026-01-01T00:00:00.000000+00:00", 5),
              {"type": "ToolResultRecorded", "recordedAt": "2026-01-01T00:00:00.010000+00:00", "data": {}},
              served(2, "2026-01-01T00:00:00.120000+00:00", 20),
              served(4, "2026-01-01T00:00:09.000000+00:00", 1)]  # after a gap (resume): not a step-to-step time
    (step, ms), = step_overheads(events)
    assert step == 2 and ms == pytest.approx(100.0)


def test_percentile_and_summary():
    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 50) == 50 and percentile(xs, 99) == 99 and percentile(xs, 100) == 100
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    s = summary_ms(xs)
    assert s["median_ms"] == 50.5 and s["p99_ms"] == 99 and s["n"] == 100
    assert summary_ms([]) == {"n": 0}


# ---------------------------------------------------------------- citations

RECORDED = {
    "abcd1234-1": {"id": "abcd1234-1", "title": "Main - CRW", "url": "https://telesystem.eu/en/", "content": "x" * 5},
    "abcd1234-2": {"id": "abcd1234-2", "title": "GROM", "url": "https://e.org/grom", "content": "y"},
    "ffff0000-1": {"id": "ffff0000-1", "title": "Other", "url": "https://o.org/", "content": "z"},
}


def web(value, kind="json") -> dict:
    return {"type": "tool-result", "toolCallId": "call_1_1", "toolName": "web_search",
            "output": {"type": kind, "value": value}}


def test_entity_items_from_served_json_a_json_string_and_a_persisted_v2_envelope():
    items = [{"id": "abcd1234-1", "title": "t", "url": "u", "content": "c"}]
    assert entity_items({"type": "json", "value": items}) == items
    assert entity_items({"type": "json", "value": json.dumps(items)}) == items
    assert entity_items({"type": "persisted", "value": {"shape": "entities", "skeleton": items, "blobRefs": []}}) \
        == items
    assert entity_items({"type": "text", "value": "<persisted-output>…"}) is None
    assert entity_items({"type": "persisted", "value": {"shape": "text"}}) is None
    assert entity_items({"type": "json", "value": "not json"}) is None


def test_trimmed_content_keeps_the_skeleton_intact():
    served = [{**RECORDED["abcd1234-1"], "content": "xx\n<persisted-output>…</persisted-output>"},
              RECORDED["abcd1234-2"]]
    c = check_citations([msg("tool", web(served))], RECORDED)
    assert (c.parts, c.parts_broken, c.items, c.intact) == (1, 0, 2, 2)
    assert c.as_dict()["intactShare"] == 1.0


def test_a_changed_url_a_lost_item_or_a_text_marker_is_a_broken_citation():
    changed = [{**RECORDED["abcd1234-1"], "url": "https://telesystem.eu/en"}, RECORDED["abcd1234-2"]]
    c = check_citations([msg("tool", web(changed))], RECORDED)
    assert (c.items, c.intact) == (2, 1)
    lost = check_citations([msg("tool", web([RECORDED["abcd1234-2"]]))], RECORDED)
    assert (lost.items, lost.intact) == (2, 1)
    marker = check_citations([msg("tool", web("<persisted-output>…", kind="text"))], RECORDED)
    assert (marker.parts, marker.parts_broken, marker.items) == (1, 1, 0)
    unknown = check_citations([msg("tool", web([{"id": "zzzz-1", "title": "", "url": ""}]))], RECORDED)
    assert unknown.parts_broken == 1
    assert check_citations([msg("tool", result("call_1_1"))], RECORDED).parts == 0  # not a web result


# ---------------------------------------------------------------- recoverability

def test_same_output_is_byte_equality_of_the_text_or_the_json_value():
    assert same_output({"type": "text", "value": "héllo\n"}, {"type": "text", "value": "héllo\n"})
    assert not same_output({"type": "text", "value": "héllo\n"}, {"type": "text", "value": "héllo"})
    items = [{"id": "a-1", "title": "t", "url": "u", "content": "long"}]
    assert same_output({"type": "json", "value": items}, {"type": "json", "value": json.dumps(items)})
    assert not same_output({"type": "json", "value": items},
                           {"type": "json", "value": [{**items[0], "content": "lo"}]})
    assert not same_output({"type": "text", "value": "x"}, {"type": "text", "value": None})


# ---------------------------------------------------------------- history after the kill test

def test_history_problems_of_a_consistent_and_a_broken_turn():
    script = [{"toolCalls": [{"toolName": "bash"}]}, {"text": "done"}]
    good = [{"id": "u", "role": "user", "parts": []},
            {"id": "a1", "role": "assistant", "turnId": "T", "parts": [call("call_1_1")]},
            {"id": "t1", "role": "tool", "turnId": "T", "parts": [result("call_1_1")]},
            {"id": "a2", "role": "assistant", "turnId": "T", "parts": [{"type": "text", "text": "done"}]}]
    assert history_problems(good, "T", script) == []
    twice = [*good, good[1]]
    problems = history_problems(twice, "T", script)
    assert any("more than once" in p for p in problems)
    assert any("assistant messages" in p for p in problems)
    assert any("orphans" in p for p in problems)


# ---------------------------------------------------------------- the STORM run as replay turns

def test_storm_turns_one_web_search_per_query_with_entities_and_the_answer_last():
    log = [{"perspective": "p", "dlg_turns": [{
        "user_utterance": "What is it?", "agent_utterance": "It is X [1].",
        "search_queries": ["q one", "q two"],
        "search_results": [
            {"url": "https://a", "title": "A", "description": "desc A", "snippets": ["s1", "s2"],
             "meta": {"query": "q one"}},
            {"url": "https://b", "title": "B", "description": "desc B", "snippets": [], "meta": {"query": "q one"}},
            {"url": "https://c", "title": "C", "description": "desc C", "snippets": ["s3"],
             "meta": {"query": "q two"}}]}]}]
    turns, recorded = storm_turns(log)
    assert len(turns) == 1
    text, script = turns[0]
    assert text == "What is it?" and script[-1] == {"text": "It is X [1]."}
    first, second = (s["toolCalls"][0] for s in script[:2])
    assert first["toolName"] == "web_search" and first["input"] == {"query": "q one"}
    items = first["output"]["value"]
    assert first["output"]["type"] == "json"
    assert [(i["title"], i["url"], i["content"]) for i in items] == [("A", "https://a", "s1\n\ns2"),
                                                                    ("B", "https://b", "desc B")]
    prefix = items[0]["id"].rsplit("-", 1)[0]
    assert len(prefix) == 8 and [i["id"] for i in items] == [f"{prefix}-1", f"{prefix}-2"]
    assert second["output"]["value"][0]["id"].rsplit("-", 1)[0] != prefix  # fresh ids per call
    assert set(recorded) == {i["id"] for s in script[:2] for i in s["toolCalls"][0]["output"]["value"]}
    assert storm_turns(log) == (turns, recorded)  # deterministic: a rerun serves the same bytes
