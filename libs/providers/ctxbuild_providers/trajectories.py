"""Recorded agent runs → replay turns: the model's decisions as ReplayProvider scripts whose tool calls carry the
recorded outputs, plus the tools the run offered.

Formats (auto-detected; all OpenAI-chat shaped):

- ``swe-agent`` — a SWE-agent ``.traj``: ``history`` with function-calling ``tool_calls`` answered by ``tool``
  messages (``tool_call_ids``). Tool definitions come from ``replay_config.agent.tools.command_docs``. A
  thought-action history (no ``tool_calls``) maps each ``action`` to a ``bash`` call, as below.
- ``mini-swe-agent`` — a ``.traj.json``: ``messages``. The model either calls the ``bash`` tool or writes one
  ```` ```bash ```` block whose observation comes back as the next user message; both become a ``bash`` call
  ``{command}``. The recorded output is the FULL output: ``extra.raw_output`` when present (the message content
  is what the harness showed, long outputs cut to head + tail), else the content.
- ``tau-bench`` — a list of episodes ``{task_id, traj, …}``; each user message of ``traj`` starts a turn.

In single-task formats (the two SWE agents) only the first user message starts a turn; later user messages that
are not observations (format-error feedback) cannot be replayed and are dropped, and a text-only assistant message
that the run continued after is merged into the next step's text — a text step would end the replayed turn.

Each turn's script ends with a text step: the turn's last assistant message when it answered in text (or called
tools whose results were never recorded — the run ended there, as mini-swe-agent's submit does), else a note
``[end of recorded trajectory…]`` (the run stopped on a tool result). A user message nobody answered (tau-bench's
closing ``###STOP###``) starts no turn.

Tools without recorded definitions get a permissive object schema built from the argument names seen (with a
JSON type where every seen value agrees).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMATS = ("swe-agent", "mini-swe-agent", "tau-bench")


class TrajectoryError(ValueError):
    """A trajectory file that cannot be read as one of the known formats (the message names the file)."""

    def __init__(self, path: str | Path, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = str(path)


@dataclass
class ReplayTurn:
    text: str  # the user message that starts the turn
    script: list[dict[str, Any]]  # ReplayProvider steps; toolCalls entries carry "output" (recorded)


@dataclass
class Trajectory:
    name: str
    format: str  # "swe-agent" | "mini-swe-agent" | "tau-bench"
    system: str | None
    tools: list[dict[str, Any]]  # {name, description, inputSchema} of the recorded tools
    turns: list[ReplayTurn] = field(default_factory=list)

    def replay_spec(self, turn: int) -> dict[str, Any]:
        """The provider spec of turn ``turn`` (0-based) for ``POST /v1/conversations/{id}/turns``."""
        if not 0 <= turn < len(self.turns):
            raise TrajectoryError(self.name, f"turn {turn} out of range: {len(self.turns)} turn(s)")
        return {"kind": "replay", "script": self.turns[turn].script, "tools": self.tools}


def load_trajectory(path: str | Path, episode: int = 0) -> Trajectory:
    """Load a recorded run (format auto-detected); ``episode`` picks one of a tau-bench file's episodes."""
    path = Path(path)
    doc = _read(path)
    fmt = detect_format(path, doc)
    if fmt == "tau-bench":
        if not 0 <= episode < len(doc):
            raise TrajectoryError(path, f"episode {episode} out of range: {len(doc)} episode(s)")
        return _tau_bench(path, doc[episode], episode)
    if episode != 0:
        raise TrajectoryError(path, f"a {fmt} trajectory has one episode; episode {episode} requested")
    return _swe_agent(path, doc) if fmt == "swe-agent" else _mini_swe_agent(path, doc)


def episode_count(path: str | Path) -> int:
    """How many episodes ``load_trajectory`` can load from the file (tau-bench: several; others: one)."""
    path = Path(path)
    doc = _read(path)
    return len(doc) if detect_format(path, doc) == "tau-bench" else 1


def detect_format(path: str | Path, doc: Any) -> str:
    if isinstance(doc, list) and doc and all(isinstance(e, dict) and isinstance(e.get("traj"), list) for e in doc):
        return "tau-bench"
    if isinstance(doc, dict) and isinstance(doc.get("history"), list) and (
            "trajectory" in doc or "replay_config" in doc or "info" in doc):
        return "swe-agent"
    if isinstance(doc, dict) and isinstance(doc.get("messages"), list) and (
            str(doc.get("trajectory_format", "")).startswith("mini-swe-agent")
            or "mini_version" in (doc.get("info") or {})):
        return "mini-swe-agent"
    raise TrajectoryError(path, f"unknown trajectory format (expected one of {', '.join(FORMATS)})")


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TrajectoryError(path, f"unknown trajectory format (not a JSON document: {exc.msg} at line "
                                    f"{exc.lineno})") from exc
    except UnicodeDecodeError as exc:
        raise TrajectoryError(path, "unknown trajectory format (not UTF-8 text)") from exc


# ---- a format-neutral event list → turns -------------------------------------------------------------------


@dataclass
class _User:
    text: str


@dataclass
class _Assistant:
    text: str
    calls: list[tuple[str | None, str, dict[str, Any]]]  # (call id, tool name, input)


@dataclass
class _Result:
    call_id: str | None  # None: answers the oldest unanswered call of the step (observation formats)
    output: str


def _end_note(exit_status: Any) -> str:
    return f"[end of recorded trajectory: {exit_status}]" if exit_status else "[end of recorded trajectory]"


def _build_turns(path: Path, events: list[_User | _Assistant | _Result], end_note: str) -> list[ReplayTurn]:
    turns: list[ReplayTurn] = []
    text: str | None = None
    steps: list[dict[str, Any]] = []
    pending: list[tuple[str | None, dict[str, Any]]] = []  # calls of the newest step still waiting for output

    def close() -> None:
        if text is None or not steps:
            return  # nobody answered this user message: nothing to replay
        last = steps[-1]
        calls = last.get("toolCalls")
        if calls and not any("output" in c for c in calls):
            steps[-1] = {"text": last.get("text") or end_note}  # the run ended on this call (e.g. a submit)
        elif calls:
            steps.append({"text": end_note})
        elif not last.get("text"):
            steps[-1] = {"text": end_note}
        turns.append(ReplayTurn(text, steps))

    for n, ev in enumerate(events):
        if isinstance(ev, _User):
            if text is not None and not steps:
                text = f"{text}\n\n{ev.text}"  # consecutive user messages: one turn
                continue
            close()
            text, steps, pending = ev.text, [], []
        elif isinstance(ev, _Assistant):
            if text is None:
                raise TrajectoryError(path, f"event {n}: an assistant message before the first user message")
            step: dict[str, Any] = {}
            if steps and "toolCalls" not in steps[-1]:
                # the run went on after a text-only answer: a text step would end the replayed turn here
                merged = "\n\n".join(t for t in (steps.pop()["text"], ev.text) if t)
                if merged:
                    step["text"] = merged
            elif ev.text:
                step["text"] = ev.text
            if ev.calls:
                step["toolCalls"] = [{"toolName": name, "input": args} for _, name, args in ev.calls]
                pending = list(zip([cid for cid, _, _ in ev.calls], step["toolCalls"], strict=True))
            else:
                step.setdefault("text", "")
                pending = []
            steps.append(step)
        else:
            match = [entry for cid, entry in pending if "output" not in entry
                     and (ev.call_id is None or cid is None or cid == ev.call_id)]
            if not match:
                raise TrajectoryError(path, f"event {n}: a tool result ({ev.call_id or 'observation'}) answering "
                                            "no call of the preceding assistant message")
            match[0]["output"] = {"type": "text", "value": ev.output}
    close()
    return turns


def _text(path: Path, content: Any) -> str:
    """Message content as text: a string, null, or a list of content blocks (text blocks kept)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    raise TrajectoryError(path, f"unexpected message content of type {type(content).__name__}")


def _calls(path: Path, n: int, msg: dict[str, Any]) -> list[tuple[str | None, str, dict[str, Any]]]:
    calls = []
    for c in msg.get("tool_calls") or []:
        fn = c.get("function") or {}
        name, raw = fn.get("name"), fn.get("arguments")
        if not name:
            raise TrajectoryError(path, f"message {n}: a tool call without a function name")
        if isinstance(raw, dict):
            args = raw
        else:
            try:
                args = json.loads(raw) if raw and raw.strip() else {}
            except json.JSONDecodeError as exc:
                raise TrajectoryError(path, f"message {n}: tool call {name} has invalid JSON arguments "
                                            f"({exc.msg})") from exc
            if not isinstance(args, dict):
                raise TrajectoryError(path, f"message {n}: tool call {name} arguments are not a JSON object")
        calls.append((c.get("id"), name, args))
    return calls


def _system(path: Path, messages: list[dict[str, Any]]) -> str | None:
    return next((_text(path, m.get("content")) for m in messages if m.get("role") == "system"), None)


# ---- the formats ---------------------------------------------------------------------------------------------

_BASH_BLOCK = re.compile(r"```bash\s*\n(.*?)\n```", re.DOTALL)


def _single_task_events(path: Path, messages: list[dict[str, Any]], command_of) -> list[Any]:
    """SWE-agent / mini-swe-agent: one task, tool results as ``tool`` messages or observations as user
    messages after an action the model wrote in text (``command_of(message) -> (command, text) | None``)."""
    events: list[Any] = []
    started = awaiting_observation = False
    for n, m in enumerate(messages):
        role = m.get("role")
        if m.get("is_demo") or role in ("system", "exit"):
            continue
        if role == "user":
            if not started:
                events.append(_User(_text(path, m.get("content"))))
                started = True
            elif awaiting_observation:
                events.append(_Result(None, _full_output(path, m)))
            awaiting_observation = False  # otherwise: feedback the replay cannot give (dropped)
        elif role == "assistant":
            text = _text(path, m.get("content"))
            calls = _calls(path, n, m)
            awaiting_observation = False
            if not calls and (action := command_of(m, text)) is not None:
                command, text = action
                calls = [(None, "bash", {"command": command})]
                awaiting_observation = True
            events.append(_Assistant(text, calls))
        elif role == "tool":
            ids = m.get("tool_call_ids") or [m.get("tool_call_id")]
            for cid in ids:
                events.append(_Result(cid, _full_output(path, m)))
        else:
            raise TrajectoryError(path, f"message {n}: unknown role {role!r}")
    return events


def _full_output(path: Path, m: dict[str, Any]) -> str:
    extra = m.get("extra")
    if isinstance(extra, dict) and isinstance(extra.get("raw_output"), str):
        return extra["raw_output"]  # the FULL output; the content may be the harness's head + tail cut
    return _text(path, m.get("content"))


def _fenced_bash(m: dict[str, Any], text: str) -> tuple[str, str] | None:
    blocks = _BASH_BLOCK.findall(text)
    if len(blocks) != 1:
        return None  # mini-swe-agent answers anything but exactly one block with a format error
    # the command travels as the tool call; the text keeps the model's reasoning (no double count)
    return blocks[0], _BASH_BLOCK.sub("", text).strip()


def _swe_action(m: dict[str, Any], text: str) -> tuple[str, str] | None:
    action = m.get("action")
    return (action, text) if isinstance(action, str) and action.strip() else None


def _mini_swe_agent(path: Path, doc: dict[str, Any]) -> Trajectory:
    messages = doc["messages"]
    info = doc.get("info") or {}
    turns = _build_turns(path, _single_task_events(path, messages, _fenced_bash), _end_note(info.get("exit_status")))
    return Trajectory(path.name, "mini-swe-agent", _system(path, messages), _inferred_tools(turns), turns)


def _swe_agent(path: Path, doc: dict[str, Any]) -> Trajectory:
    history = doc["history"]
    info = doc.get("info") or {}
    turns = _build_turns(path, _single_task_events(path, history, _swe_action), _end_note(info.get("exit_status")))
    documented = _swe_agent_tools(doc.get("replay_config"))
    names = {t["name"] for t in documented}
    tools = documented + [t for t in _inferred_tools(turns) if t["name"] not in names]
    return Trajectory(path.name, "swe-agent", _system(path, history), tools, turns)


def _tau_bench(path: Path, ep: dict[str, Any], episode: int) -> Trajectory:
    events: list[Any] = []
    traj = ep["traj"]
    for n, m in enumerate(traj):
        role = m.get("role")
        if role == "system":
            continue
        if role == "user":
            events.append(_User(_text(path, m.get("content"))))
        elif role == "assistant":
            events.append(_Assistant(_text(path, m.get("content")), _calls(path, n, m)))
        elif role == "tool":
            events.append(_Result(m.get("tool_call_id"), _text(path, m.get("content"))))
        else:
            raise TrajectoryError(path, f"episode {episode} message {n}: unknown role {role!r}")
    turns = _build_turns(path, events, _end_note(None))
    name = f"{path.name}#{episode}" + (f" (task {ep['task_id']})" if "task_id" in ep else "")
    return Trajectory(name, "tau-bench", _system(path, traj), _inferred_tools(turns), turns)


# ---- tool schemas --------------------------------------------------------------------------------------------

_JSON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number", list: "array", dict: "object",
               type(None): "null"}


def _inferred_tools(turns: list[ReplayTurn]) -> list[dict[str, Any]]:
    """Permissive schemas from the calls seen: every argument name, typed only where all values agree."""
    seen: dict[str, dict[str, set[str]]] = {}
    for turn in turns:
        for step in turn.script:
            for call in step.get("toolCalls", []):
                args = seen.setdefault(call["toolName"], {})
                for key, value in call["input"].items():
                    args.setdefault(key, set()).add(_JSON_TYPES.get(type(value), "string"))
    tools = []
    for name, args in seen.items():
        props = {}
        for key, types in args.items():
            if types == {"integer", "number"}:
                types = {"number"}
            props[key] = {"type": next(iter(types))} if len(types) == 1 else {}
        tools.append({"name": name, "description": f"{name} (recorded tool; schema inferred from its calls)",
                      "inputSchema": {"type": "object", "properties": props}})
    return tools


_DOC_TOOL = re.compile(r"^(\S[^:]*):\s*$")
_DOC_FIELD = re.compile(r"^  (docstring|signature|arguments):\s?(.*)$")
_DOC_ARG = re.compile(r"^\s*- (\S+) \(([^)]+)\) \[(required|optional)\]:\s?(.*)$")
_SCHEMA_TYPES = {"string", "integer", "number", "boolean", "array", "object"}


def _swe_agent_tools(replay_config: Any) -> list[dict[str, Any]]:
    """SWE-agent's tool documentation (``command_docs``, the YAML-like text its prompt shows) → schemas."""
    if isinstance(replay_config, str):
        try:
            replay_config = json.loads(replay_config)
        except json.JSONDecodeError:
            return []
    docs = (((replay_config or {}).get("agent") or {}).get("tools") or {}).get("command_docs")
    if not isinstance(docs, str):
        return []
    tools: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    fld = None
    for line in docs.splitlines():
        if m := _DOC_TOOL.match(line):
            current = {"name": m.group(1).strip(), "docstring": [], "args": []}
            tools.append(current)
            fld = None
        elif current is None:
            continue
        elif m := _DOC_FIELD.match(line):
            fld = m.group(1)
            if fld == "docstring" and m.group(2):
                current["docstring"].append(m.group(2))
        elif fld == "arguments" and (m := _DOC_ARG.match(line)):
            current["args"].append(m.groups())
        elif fld == "docstring" and line.strip():
            current["docstring"].append(line.strip())
    out = []
    for t in tools:
        props = {name: {"type": kind if kind in _SCHEMA_TYPES else "string", "description": desc}
                 for name, kind, _, desc in t["args"]}
        schema: dict[str, Any] = {"type": "object", "properties": props}
        required = [name for name, _, req, _ in t["args"] if req == "required"]
        if required:
            schema["required"] = required
        out.append({"name": t["name"], "description": " ".join(t["docstring"]), "inputSchema": schema})
    return out
