"""Trajectory loaders on small synthetic files (written here, in each recorded format): turns, scripts with the
recorded (full) outputs, tool schemas, and typed errors for what is not a known format."""

from __future__ import annotations

import json

import pytest
from ctxbuild_providers import (
    ModelRequest,
    ReplayProvider,
    Trajectory,
    TrajectoryError,
    episode_count,
    load_trajectory,
)


def fc(call_id: str, name: str, args: dict | str) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}


def write(tmp_path, name: str, doc) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


COMMAND_DOCS = """bash:
  docstring: runs the given command directly in bash
  signature: <command>
  arguments:
    - command (string) [required]: a command to run directly in the current shell

open:
  docstring: opens the file at the given path in the editor. If line_number is provided, the window will be \
move to include that line
  signature: open "<path>" [<line_number>]
  arguments:
    - path (string) [required]: the path to the file to open
    - line_number (integer) [optional]: the line number to move the window to

edit:
  docstring: Replace first occurrence of <search> with <replace>.

  signature: edit <search> <replace> [<replace-all>]

  arguments:
    - search (string) [required]: the text to search for
    - replace-all (boolean) [optional]: replace all occurrences

submit:
  docstring: submits the current file
  signature: submit

"""


def swe_agent_doc() -> dict:
    return {
        "environment": "main", "trajectory": [], "info": {"exit_status": "submitted"},
        "replay_config": json.dumps({"agent": {"tools": {"command_docs": COMMAND_DOCS}}}),  # a string in the wild
        "history": [
            {"role": "system", "content": "You are an autonomous programmer.", "message_type": "system_prompt"},
            {"role": "user", "content": [{"type": "text", "text": "Fix the bug."}], "message_type": "observation"},
            {"role": "assistant", "content": "Look first.", "thought": "Look first.", "action": "ls",
             "tool_calls": [fc("call_same", "bash", {"command": "ls"})]},
            {"role": "tool", "content": [{"type": "text", "text": "a.py\n"}], "tool_call_ids": ["call_same"]},
            {"role": "assistant", "content": "Open it.", "action": "open a.py 3",
             "tool_calls": [fc("call_same", "open", {"path": "a.py", "line_number": 3})]},  # ids repeat in SWE-agent
            {"role": "tool", "content": "[File: a.py]\n1:x = 1", "tool_call_ids": ["call_same"]},
            {"role": "assistant", "content": "", "action": "submit", "tool_calls": [fc("call_submit", "submit", {})]},
            {"role": "tool", "content": "diff --git a/a.py b/a.py", "tool_call_ids": ["call_submit"]},
        ]}


def test_swe_agent_function_calling_history(tmp_path):
    t = load_trajectory(write(tmp_path, "x.traj", swe_agent_doc()))
    assert (t.format, t.name, t.system) == ("swe-agent", "x.traj", "You are an autonomous programmer.")
    (turn,) = t.turns
    assert turn.text == "Fix the bug."
    assert turn.script == [
        {"text": "Look first.", "toolCalls": [{"toolName": "bash", "input": {"command": "ls"},
                                               "output": {"type": "text", "value": "a.py\n"}}]},
        {"text": "Open it.", "toolCalls": [{"toolName": "open", "input": {"path": "a.py", "line_number": 3},
                                            "output": {"type": "text", "value": "[File: a.py]\n1:x = 1"}}]},
        {"toolCalls": [{"toolName": "submit", "input": {},
                        "output": {"type": "text", "value": "diff --git a/a.py b/a.py"}}]},
        {"text": "[end of recorded trajectory: submitted]"},  # the run stopped on a tool result
    ]
    tools = {x["name"]: x for x in t.tools}
    assert list(tools) == ["bash", "open", "edit", "submit"]
    assert tools["open"]["inputSchema"] == {"type": "object", "required": ["path"], "properties": {
        "path": {"type": "string", "description": "the path to the file to open"},
        "line_number": {"type": "integer", "description": "the line number to move the window to"}}}
    assert tools["edit"]["description"] == "Replace first occurrence of <search> with <replace>."
    assert tools["edit"]["inputSchema"]["properties"]["replace-all"]["type"] == "boolean"
    assert tools["submit"]["inputSchema"] == {"type": "object", "properties": {}}


def test_swe_agent_thought_action_history_maps_actions_to_bash(tmp_path):
    doc = {"info": {}, "history": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Fix it."},
        {"role": "assistant", "content": "DISCUSSION\nlist files\n\n```\nls\n```", "action": "ls"},
        {"role": "user", "content": "a.py"},
        {"role": "assistant", "content": "oops, no command", "action": ""},
        {"role": "user", "content": "Your output could not be parsed."},  # feedback: not replayable, dropped
        {"role": "assistant", "content": "Done.", "action": "submit"},
    ]}
    (turn,) = load_trajectory(write(tmp_path, "y.traj", doc)).turns
    assert turn.script == [
        {"text": "DISCUSSION\nlist files\n\n```\nls\n```",
         "toolCalls": [{"toolName": "bash", "input": {"command": "ls"}, "output": {"type": "text", "value": "a.py"}}]},
        {"text": "oops, no command\n\nDone."},  # merged: the run went on after the text-only answer
    ]


def mini_tool_calling_doc() -> dict:
    return {"trajectory_format": "mini-swe-agent-1.1", "info": {"exit_status": "Submitted"}, "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "<pr_description>fix</pr_description>"},
        {"role": "assistant", "content": "Find files.", "tool_calls": [fc("call_00_a", "bash", {"command": "find ."})],
         "extra": {"actions": [{"command": "find .", "tool_call_id": "call_00_a"}]}},
        {"role": "tool", "tool_call_id": "call_00_a",
         "content": "<returncode>0</returncode>\n<output_head>\nA</output_head>\n<elided_chars>\n",
         "extra": {"raw_output": "A" * 12_000, "returncode": 0}},
        {"role": "assistant", "content": "Make patch.",
         "tool_calls": [fc("call_00_b", "bash", {"command": "git diff"})]},
        {"role": "tool", "tool_call_id": "call_00_b", "content": "<returncode>0</returncode>\n<output>\n</output>",
         "extra": {"raw_output": "", "returncode": 0}},  # an empty full output is still the full output
        {"role": "assistant", "content": "Submitting.",
         "tool_calls": [fc("call_00_c", "bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"})]},
        {"role": "exit", "content": "diff", "extra": {"exit_status": "Submitted", "submission": "diff"}},
    ]}


def test_mini_swe_agent_tool_calls_record_the_full_output(tmp_path):
    t = load_trajectory(write(tmp_path, "run.traj.json", mini_tool_calling_doc()))
    assert t.format == "mini-swe-agent" and t.system == "You are a helpful assistant."
    (turn,) = t.turns
    assert [s.get("toolCalls", [{}])[0].get("output") for s in turn.script] == [
        {"type": "text", "value": "A" * 12_000}, {"type": "text", "value": ""}, None]
    # the submit call was never answered (the run exited): the last step is the model's text
    assert turn.script[-1] == {"text": "Submitting."}
    assert t.tools == [{"name": "bash", "description": "bash (recorded tool; schema inferred from its calls)",
                        "inputSchema": {"type": "object", "properties": {"command": {"type": "string"}}}}]


def test_mini_swe_agent_fenced_bash_blocks(tmp_path):
    doc = {"trajectory_format": "mini-swe-agent-1", "info": {"exit_status": "Submitted"}, "messages": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "task"},
        {"role": "assistant", "content": "THOUGHT: look\n\n```bash\nls -la\n```"},
        {"role": "user", "content": "<returncode>0</returncode>\n<output>\ncut</output>",
         "extra": {"raw_output": "total 0\nfull listing\n"}},
        {"role": "assistant", "content": "Two commands:\n```bash\nls\n```\n```bash\npwd\n```"},
        {"role": "user", "content": "Please always provide EXACTLY ONE action in triple backticks."},
        {"role": "assistant", "content": "THOUGHT: again\n\n```bash\ncat a.py\n```"},
        {"role": "user", "content": "<returncode>0</returncode>\n<output>\nx = 1\n</output>"},
    ]}
    t = load_trajectory(write(tmp_path, "fenced.traj.json", doc))
    assert t.turns[0].script == [
        {"text": "THOUGHT: look", "toolCalls": [{"toolName": "bash", "input": {"command": "ls -la"},
                                                 "output": {"type": "text", "value": "total 0\nfull listing\n"}}]},
        {"text": "Two commands:\n```bash\nls\n```\n```bash\npwd\n```\n\nTHOUGHT: again",
         "toolCalls": [{"toolName": "bash", "input": {"command": "cat a.py"},
                        "output": {"type": "text",
                                   "value": "<returncode>0</returncode>\n<output>\nx = 1\n</output>"}}]},
        {"text": "[end of recorded trajectory: Submitted]"},
    ]


def tau_doc() -> list:
    def ep(task_id, traj):
        return {"task_id": task_id, "reward": 1.0, "info": {}, "trial": 0, "traj": traj}

    return [
        ep(7, [
            {"role": "system", "content": "# Airline policy"},
            {"role": "user", "content": "Hi, change my flight."},
            {"role": "assistant", "content": "Your user id?"},
            {"role": "user", "content": "It is u_1."},
            {"role": "user", "content": "(and the reservation is R1)"},
            {"role": "assistant", "content": None, "tool_calls": [
                fc("call_1", "get_user_details", {"user_id": "u_1"}),
                fc("call_2", "get_reservation_details", {"reservation_id": "R1"})]},
            {"role": "tool", "tool_call_id": "call_2", "name": "get_reservation_details", "content": '{"id": "R1"}'},
            {"role": "tool", "tool_call_id": "call_1", "name": "get_user_details", "content": '{"name": "A"}'},
            {"role": "assistant", "content": "Found it.", "tool_calls": [
                fc("call_3", "calculate", {"expression": "1+1"})]},
            {"role": "tool", "tool_call_id": "call_3", "name": "calculate", "content": "2"},
            {"role": "assistant", "content": "The change costs 2."},
            {"role": "user", "content": "Thanks ###STOP###"},  # nobody answered: no turn
        ]),
        ep(8, [
            {"role": "system", "content": "# Airline policy"},
            {"role": "user", "content": "Cancel R2."},
            {"role": "assistant", "content": None, "tool_calls": [fc("call_9", "calculate", {"expression": 3})]},
            {"role": "tool", "tool_call_id": "call_9", "name": "calculate", "content": "3"},
        ]),
    ]


def test_tau_bench_episodes_and_turns(tmp_path):
    path = write(tmp_path, "tau.json", tau_doc())
    assert episode_count(path) == 2
    t = load_trajectory(path)
    assert t.format == "tau-bench" and t.name == "tau.json#0 (task 7)" and t.system == "# Airline policy"
    assert [turn.text for turn in t.turns] == ["Hi, change my flight.", "It is u_1.\n\n(and the reservation is R1)"]
    assert t.turns[0].script == [{"text": "Your user id?"}]
    assert t.turns[1].script == [
        {"toolCalls": [
            {"toolName": "get_user_details", "input": {"user_id": "u_1"},
             "output": {"type": "text", "value": '{"name": "A"}'}},  # matched by id, not by position
            {"toolName": "get_reservation_details", "input": {"reservation_id": "R1"},
             "output": {"type": "text", "value": '{"id": "R1"}'}}]},
        {"text": "Found it.", "toolCalls": [{"toolName": "calculate", "input": {"expression": "1+1"},
                                             "output": {"type": "text", "value": "2"}}]},
        {"text": "The change costs 2."}]
    assert t.replay_spec(1) == {"kind": "replay", "script": t.turns[1].script, "tools": t.tools}
    with pytest.raises(TrajectoryError, match="turn 2 out of range"):
        t.replay_spec(2)

    second = load_trajectory(path, episode=1)
    assert second.name == "tau.json#1 (task 8)"
    assert second.turns[0].script[-1] == {"text": "[end of recorded trajectory]"}
    with pytest.raises(TrajectoryError, match="episode 2 out of range"):
        load_trajectory(path, episode=2)


def test_inferred_schemas_type_only_what_all_calls_agree_on(tmp_path):
    doc = tau_doc()
    doc[0]["traj"][8]["tool_calls"][0] = fc("call_3", "calculate", {"expression": "1+1"})
    doc[0]["traj"].insert(10, {"role": "assistant", "content": None,
                               "tool_calls": [fc("call_4", "calculate", {"expression": 2.5, "n": 1})]})
    doc[0]["traj"].insert(11, {"role": "tool", "tool_call_id": "call_4", "content": "2.5"})
    t = load_trajectory(write(tmp_path, "tau.json", doc))
    calc = next(x for x in t.tools if x["name"] == "calculate")
    assert calc["inputSchema"] == {"type": "object", "properties": {"expression": {}, "n": {"type": "integer"}}}


async def test_a_loaded_trajectory_replays_with_its_recorded_outputs(tmp_path):
    t = load_trajectory(write(tmp_path, "x.traj", swe_agent_doc()))
    turn = t.turns[0]
    provider = ReplayProvider(**{k: v for k, v in t.replay_spec(0).items() if k != "kind"})
    assert [s.name for s in provider.recorded_tools] == ["bash", "open", "edit", "submit"]
    request = ModelRequest("replay", t.system or "", [{"id": "u", "role": "user",
                                                       "parts": [{"type": "text", "text": turn.text}]}])
    played = []
    for step in range(1, len(turn.script) + 1):
        r = await provider.complete(request, step=step)
        played += [(c["toolName"], provider.recorded_output(c["toolCallId"])["value"]) for c in r.tool_calls]
    assert played == [("bash", "a.py\n"), ("open", "[File: a.py]\n1:x = 1"), ("submit", "diff --git a/a.py b/a.py")]
    assert r.stop_reason == "stop"


@pytest.mark.parametrize(("name", "content", "message"), [
    ("t.jsonl", '{"type": "user"}\n{"type": "assistant"}\n', "not a JSON document"),
    ("t.json", json.dumps({"messages": [{"role": "user", "content": "hi"}]}), "unknown trajectory format"),
    ("t.json", json.dumps([1, 2]), "unknown trajectory format"),
    ("t.bin", "\udcff", "not UTF-8"),
])
def test_unknown_formats_are_a_typed_error_naming_the_file(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content.encode("utf-8", "surrogateescape"))
    with pytest.raises(TrajectoryError, match=message) as err:
        load_trajectory(path)
    assert err.value.path == str(path) and str(path) in str(err.value)


def test_malformed_recordings_are_a_typed_error(tmp_path):
    bad_args = swe_agent_doc()
    bad_args["history"][2]["tool_calls"][0]["function"]["arguments"] = '{"command": "ls'
    with pytest.raises(TrajectoryError, match="message 2: tool call bash has invalid JSON"):
        load_trajectory(write(tmp_path, "a.traj", bad_args))
    orphan = tau_doc()
    orphan[0]["traj"][6]["tool_call_id"] = "call_nope"
    with pytest.raises(TrajectoryError, match="answering no call"):
        load_trajectory(write(tmp_path, "b.json", orphan))
    with pytest.raises(TrajectoryError, match="one episode"):
        load_trajectory(write(tmp_path, "c.traj", swe_agent_doc()), episode=1)


def test_replay_spec_of_a_trajectory_without_turns():
    t = Trajectory("n", "tau-bench", None, [], [])
    with pytest.raises(TrajectoryError, match="0 turn"):
        t.replay_spec(0)
