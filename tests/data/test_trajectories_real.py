"""The trajectory loaders on the real runs in ../shared/data/trajectories: the counts SOURCES.md states, the FULL
recorded outputs (mini-swe-agent's ``extra.raw_output``, not the head + tail the model was shown), tool schemas
that fit every recorded call, and a replay of every turn that hands back exactly the recorded outputs."""

from __future__ import annotations

import json

import pytest
from ctxbuild_providers import ModelRequest, ReplayProvider, TrajectoryError, episode_count, load_trajectory

pytestmark = [pytest.mark.shared_data]

SWE = "trajectories/01_sweagent_marshmallow-1867_function_calling.traj"
MINI = "trajectories/03_miniswe_deepseek-chat_sqlfluff-1733.traj.json"
TAU = "trajectories/05_taubench_gpt-4o-airline_subset.json"
CLAUDE_CODE = "trajectories/07_claudecode_transcript_with_compaction.jsonl"


def recorded(t) -> list[dict]:
    return [c for turn in t.turns for step in turn.script for c in step.get("toolCalls", []) if "output" in c]


def test_swe_agent_counts_and_documented_tools(shared_data):
    t = load_trajectory(shared_data / SWE)
    assert t.format == "swe-agent" and len(t.turns) == 1
    outputs = recorded(t)
    assert len(outputs) == 11  # SOURCES.md: 24 messages, 11 tool results (max 9.0K chars)
    assert 9_000 <= max(len(c["output"]["value"]) for c in outputs) < 9_100
    history = json.loads((shared_data / SWE).read_text())["history"]
    assert [c["output"]["value"] for c in outputs] == [m["content"] for m in history if m["role"] == "tool"]
    # the schemas come from the run's own command docs and fit every recorded call
    tools = {x["name"]: x["inputSchema"] for x in t.tools}
    assert {"bash", "create", "insert", "find_file", "open", "edit", "submit"} <= set(tools)
    for call in outputs:
        schema = tools[call["toolName"]]
        assert set(call["input"]) <= set(schema["properties"]) and set(schema.get("required", [])) <= set(call["input"])


def test_mini_swe_agent_records_the_full_outputs(shared_data):
    t = load_trajectory(shared_data / MINI)
    assert t.format == "mini-swe-agent" and len(t.turns) == 1
    assert len(t.turns[0].script) == 80  # 80 model calls
    outputs = recorded(t)
    assert len(outputs) == 79  # SOURCES.md: 79 tool results
    tool_msgs = [m for m in json.loads((shared_data / MINI).read_text())["messages"] if m["role"] == "tool"]
    assert [c["output"]["value"] for c in outputs] == [m["extra"]["raw_output"] for m in tool_msgs]
    assert max(len(c["output"]["value"]) for c in outputs) == 110_817  # SOURCES.md: max 110,817 chars
    cut = [(c, m) for c, m in zip(outputs, tool_msgs, strict=True) if "<elided_chars>" in m["content"]]
    assert cut and all(len(c["output"]["value"]) > 10_000 and "<elided_chars>" not in c["output"]["value"]
                       for c, _ in cut)
    assert {x["name"] for x in t.tools} == {"bash"}


def test_tau_bench_episodes(shared_data):
    path = shared_data / TAU
    assert episode_count(path) == 5  # SOURCES.md: 5 of 200 episodes
    episodes = [load_trajectory(path, e) for e in range(5)]
    assert sum(len(recorded(t)) for t in episodes) == 74  # SOURCES.md: 74 tool results
    raw = json.loads(path.read_text())
    for t, ep in zip(episodes, raw, strict=True):
        assert t.format == "tau-bench" and t.system.startswith("# Airline Agent Policy")
        answered_users = sum(1 for i, m in enumerate(ep["traj"]) if m["role"] == "user"
                             and any(n["role"] == "assistant" for n in ep["traj"][i + 1:]))
        assert len(t.turns) == answered_users  # each answered user message starts a turn
        # call ids repeat across steps of an episode: results pair with the call of their own step
        assert [c["output"]["value"] for c in recorded(t)] == [m["content"] for m in ep["traj"] if m["role"] == "tool"]


@pytest.mark.parametrize("name", [SWE, MINI, TAU])
async def test_every_turn_replays_its_recorded_outputs(shared_data, name):
    path = shared_data / name
    for episode in range(episode_count(path)):
        t = load_trajectory(path, episode)
        for n, turn in enumerate(t.turns):
            spec = t.replay_spec(n)
            provider = ReplayProvider(spec["script"], tools=spec["tools"])
            request = ModelRequest("replay", t.system or "", [{"id": "u", "role": "user",
                                                               "parts": [{"type": "text", "text": turn.text}]}],
                                   provider.recorded_tools)
            served = []
            for step in range(1, len(turn.script) + 1):
                r = await provider.complete(request, step=step)
                served += [provider.recorded_output(c["toolCallId"]) for c in r.tool_calls]
            assert served == [c.get("output") for s in turn.script for c in s.get("toolCalls", [])]
            assert r.stop_reason == "stop"  # every turn ends on a text step


def test_a_transcript_in_another_format_is_a_typed_error(shared_data):
    with pytest.raises(TrajectoryError) as err:
        load_trajectory(shared_data / CLAUDE_CODE)
    assert CLAUDE_CODE.split("/")[1] in str(err.value) and "unknown trajectory format" in str(err.value)
