"""The `ctxbuild` CLI against the six services running as processes: new → send (attachment + replay script) →
history → request (hash check) → result; watch resuming through dropped connections; abort; regenerate; a
synthetic trajectory replayed end to end; the installed console script."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from ctxbuild_cli.main import app
from typer.testing import CliRunner, Result

pytestmark = pytest.mark.e2e

CTXBUILD = Path(sys.executable).with_name("ctxbuild")
LINES = [f"{i:04d} 2026-11-30T10:{i // 60 % 60:02d}:{i % 60:02d}Z api-{i % 7} GET /v1/items/{i * 37 % 1000} 200"
         for i in range(600)]
NOTES = "\n".join(LINES) + "\n"  # ~32 KB: a read_file page of it is over a 16k window's in-flight threshold
READ_SCRIPT = [{"toolCalls": [{"toolName": "read_file", "input": {"filename": "notes.txt", "limit": 8000}}]},
               {"text": "notes.txt is an access log of GET requests."}]
# TODO(lead): the endpoints marked (new) in issue #9 skip on 404/405 until every server has them; drop the skips.


class Cli:
    def __init__(self, url: str, api_key: str) -> None:
        self.url, self.api_key = url, api_key
        self.runner = CliRunner()

    def __call__(self, *args: str, url: str | None = None) -> Result:
        return self.runner.invoke(app, ["--url", url or self.url, "--api-key", self.api_key, *args],
                                  env={"COLUMNS": "220"})

    def json(self, *args: str, url: str | None = None) -> dict:
        result = self(*args, "--json", url=url)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)


@pytest.fixture(scope="module")
def cli(stack, all_services) -> Cli:
    return Cli(all_services, stack.env["CTX_API_KEY"])


@pytest.fixture(scope="module")
def sent(cli, tmp_path_factory) -> dict:
    """One conversation: an attachment and a replayed turn that reads it (the read is trimmed and offloaded)."""
    folder = tmp_path_factory.mktemp("cli")
    (folder / "notes.txt").write_text(NOTES)
    (folder / "read.json").write_text(json.dumps(READ_SCRIPT))
    conv = cli.json("new", "--title", "cli e2e", "--context-window", "16000")
    turn = cli.json("send", conv["id"], "what is in notes.txt?", "--attach", str(folder / "notes.txt"),
                    "--script", str(folder / "read.json"))
    return {"conv": conv, "turn": turn, "folder": folder}


def test_new_prints_the_id_and_keeps_settings(cli):
    result = cli("new", "--context-window", "32000", "--mcp-server", "time", "--setting", "truncateThreshold=6000")
    assert result.exit_code == 0, result.output
    cid = result.stdout.strip()
    assert re.fullmatch(r"conv_[0-9a-f]{20}", cid)
    conv = cli.json("new", "--context-window", "32000", "--mcp-mode", "disabled")
    assert conv["settings"]["contextWindow"] == 32000 and conv["settings"]["mcpMode"] == "disabled"


def test_send_uploads_runs_and_reports_each_step(sent):
    turn = sent["turn"]
    assert turn["status"] == "completed", turn
    assert turn["text"] == READ_SCRIPT[-1]["text"]
    [att] = turn["attachments"]
    assert att["handle"] == "notes.txt" and att["size"] == len(NOTES.encode())
    assert att["sha256"] == hashlib.sha256(NOTES.encode()).hexdigest() and att["mediaType"] == "text/plain"
    one, two = turn["steps"]
    assert [c["toolName"] for c in one["toolCalls"]] == ["read_file"]
    assert one["toolCalls"][0]["trimmed"] and one["toolCalls"][0]["offloaded"]
    assert one["compaction"] and one["compaction"][0].startswith("turn-start: ")
    assert two["servedTokens"] > one["servedTokens"] and two["toolCalls"] == []
    versions = [e["version"] for e in turn["events"]]
    assert versions == list(range(versions[0], versions[0] + len(versions)))  # in order, none missing
    assert turn["events"][-1]["type"] == "TurnCompleted"


def test_send_renders_the_table_and_the_answer(cli, sent):
    result = cli("send", sent["conv"]["id"], "and again", "--script", str(sent["folder"] / "read.json"))
    assert result.exit_code == 0, result.output
    assert "served tokens" in result.stdout and "read_file ✂→blob" in result.stdout
    assert "completed — 2 model call(s)" in result.stdout
    assert result.stdout.rstrip().endswith(READ_SCRIPT[-1]["text"])
    assert "attached" not in result.stderr and re.search(r"turn turn_\w+ \(replay\)", result.stderr)


def test_history_shows_the_path_and_the_trimmed_result(cli, sent):
    hist = cli.json("history", sent["conv"]["id"])
    roles = [m["role"] for m in hist["messages"]]
    assert roles[:4] == ["user", "assistant", "tool", "assistant"]
    result = cli("history", sent["conv"]["id"])
    assert result.exit_code == 0, result.output
    assert "notes.txt" in result.stdout and "what is in notes.txt?" in result.stdout
    assert re.search(r"← read_file: [\d,]+ chars \[trimmed from [\d,]+ chars, full text", result.stdout)


def test_request_step_1_hashes_to_its_request_hash(cli, sent):
    cid, turn = sent["conv"]["id"], sent["turn"]
    tid, step1 = turn["turnId"], turn["steps"][0]
    summary = cli("request", cid, tid, "1")
    assert summary.exit_code == 0, summary.output
    assert "matches StepServed" in summary.stdout and step1["requestHash"] in summary.stdout
    raw = cli("request", cid, tid, "1", "--raw")
    assert hashlib.sha256(raw.stdout_bytes).hexdigest() == step1["requestHash"]
    doc = cli.json("request", cid, tid, "1")
    assert doc["match"] in ("body", "re-rendered") and doc["requestHash"] == step1["requestHash"]
    assert doc["summary"]["roles"] == {"user": 1} and doc["summary"]["tools"][:1] == ["read_file"]
    missing = cli("request", cid, tid, "9")
    assert missing.exit_code == 4 and "not-found" in missing.stderr


def test_result_reads_the_trimmed_output_back_in_full(cli, sent):
    cid, tid = sent["conv"]["id"], sent["turn"]["turnId"]
    hist = cli.json("history", cid)
    tool_msg = next(m for m in hist["messages"] if m["role"] == "tool" and m.get("turnId") == tid)
    part = tool_msg["parts"][0]
    result = cli("result", cid, tool_msg["id"], part["toolCallId"])
    assert result.exit_code == 0, result.output
    full = result.stdout
    assert len(full) > len(part["output"]["value"]) and part["offload"]["totalChars"] <= len(full)
    # the page the model asked for (8,000 chars of the file), every line of it, none lost to the trim
    assert all(line in full for line in LINES[:5]) and LINES[100] in full


def test_a_failing_turn_exits_1_with_its_reason(cli, sent, tmp_path):
    bad = tmp_path / "bad.json"  # asks for an archived URI in a fresh conversation: the replay cannot answer
    bad.write_text(json.dumps([{"toolCalls": [{"toolName": "fs_read", "input": {"uri": "{{offload_uri:3}}"}}]}]))
    cid = cli("new").stdout.strip()
    result = cli("send", cid, "read the third archive", "--script", str(bad))
    assert result.exit_code == 1, result.output
    assert "turn failed:" in result.stderr and "offload_uri:3" in result.stderr
    unknown = cli("send", "conv_doesnotexist", "hi", "--script", str(bad))
    assert unknown.exit_code == 4 and "not-found" in unknown.stderr


class CuttingProxy:
    """A TCP proxy in front of the orchestration service that drops every event-stream connection as soon as it
    has relayed one complete SSE event: a follower only gets the whole turn by resuming with Last-Event-ID."""

    EVENT_END = re.compile(rb"\ndata:[^\r\n]*\r?\n\r?\n")

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = self.cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.upstream)
        threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
        seen, relayed = b"", 0
        try:
            while data := upstream.recv(65536):
                seen += data
                end = self.EVENT_END.search(seen, relayed) if b"text/event-stream" in seen else None
                # relay up to the end of the first event only, even when more arrived in the same read
                client.sendall(seen[relayed:end.end() if end else len(seen)])
                relayed = len(seen)
                if end:
                    self.cuts += 1
                    break
        except OSError:
            pass
        for s in (client, upstream):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.listener.close()


def test_watch_resumes_after_dropped_connections(cli, sent, all_services):
    cid, turn = sent["conv"]["id"], sent["turn"]
    proxy = CuttingProxy(all_services)
    try:
        watched = cli.json("watch", cid, turn["turnId"], url=proxy.url)
    finally:
        proxy.close()
    assert proxy.cuts >= 2 and proxy.connections > proxy.cuts  # it was cut, reconnected, and went on
    assert [e["version"] for e in watched["events"]] == [e["version"] for e in turn["events"]]
    assert watched["status"] == "completed" and watched["text"] == turn["text"]
    assert watched["steps"] == turn["steps"]


def test_watch_after_a_version_starts_there(cli, sent):
    cid, turn = sent["conv"]["id"], sent["turn"]
    versions = [e["version"] for e in turn["events"]]
    later = cli.json("watch", cid, turn["turnId"], "--after", str(versions[2]))
    assert [e["version"] for e in later["events"]] == versions[3:]
    ended = cli.json("watch", cid, turn["turnId"], "--after", str(versions[-1]))  # returns, does not wait
    assert ended["status"] == "completed" and [e["version"] for e in ended["events"]] == versions[-1:]
    missing = cli("watch", cid, "turn_doesnotexist")
    assert missing.exit_code == 4 and "not-found" in missing.stderr


def test_abort_stops_a_running_turn(cli, sent):
    cid = sent["conv"]["id"]
    long = sent["folder"] / "long.json"  # 19 trimmed page reads: the abort lands long before the last one
    long.write_text(json.dumps(
        [{"toolCalls": [{"toolName": "read_file", "input": {"filename": "notes.txt", "offset": 8000 * (k % 4),
                                                             "limit": 8000}}]} for k in range(19)]
        + [{"text": "read it all"}]))
    tid = cli("send", cid, "read notes.txt page by page", "--script", str(long), "--max-steps", "20",
              "--no-follow").stdout.strip()
    result = cli("abort", cid, tid, "--reason", "cli e2e")
    if result.exit_code == 4 and "conflict" in result.stderr:
        pytest.skip(f"the turn ended before the abort arrived: {result.stderr.strip()}")
    assert result.exit_code == 0, result.output
    watched = cli("watch", cid, tid, "--json")
    assert watched.exit_code == 1, watched.output
    doc = json.loads(watched.stdout)
    assert doc["status"] == "failed" and doc["failure"]["code"] and len(doc["steps"]) < 20
    assert any("abort requested: cli e2e" in n for n in doc["notes"])
    again = cli("abort", cid, tid)
    assert again.exit_code == 4 and "conflict" in again.stderr


def test_regenerate_answers_again_on_a_sibling_branch(cli, sent, tmp_path):
    cid, first = sent["conv"]["id"], sent["turn"]
    other = tmp_path / "other.json"
    other.write_text(json.dumps([{"text": "a second opinion: it is an access log."}]))
    result = cli("regenerate", cid, first["turnId"], "--script", str(other), "--json")
    assert result.exit_code == 0, result.output
    again = json.loads(result.stdout)
    assert again["status"] == "completed" and again["text"] == "a second opinion: it is an access log."
    assert again["turnId"] != first["turnId"] and again["regenerated"] == first["turnId"]
    tree = cli.json("history", cid, "--branches")
    # the path now ends on the new answer; the first one is its sibling under the same user message
    [second_answer] = [m for m in tree["messages"] if m["id"] == again["messageIds"][0]]
    assert second_answer["parentId"] == first["userMessageId"]
    assert tree["branches"][second_answer["id"]] == [first["messageIds"][0], second_answer["id"]]
    shown = cli("history", cid, "--branches")
    assert f"[branch 2/2; other: {first['messageIds'][0]}]" in shown.stdout


def synthetic_trajectory(path: Path) -> list[int]:
    """A tau-bench-shaped episode of two user turns; the second reads a 40 KB record. Returns model calls/turn."""
    big = "\n".join(f'{{"flight": "HAT{i:03d}", "seat": "{i % 30}{"ABCDEF"[i % 6]}", "status": "ok"}}'
                    for i in range(800))

    def call(cid: str, name: str, args: dict) -> dict:
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}

    traj = [{"role": "system", "content": "You are an airline agent."},
            {"role": "user", "content": "Which user am I? My id is mia_1."},
            call("c1", "get_user_details", {"user_id": "mia_1"}),
            {"role": "tool", "tool_call_id": "c1", "content": '{"name": "Mia", "reservations": ["R1"]}'},
            {"role": "assistant", "content": "You are Mia with one reservation, R1."},
            {"role": "user", "content": "List every seat on R1."},
            call("c2", "get_reservation_details", {"reservation_id": "R1"}),
            {"role": "tool", "tool_call_id": "c2", "content": big},
            call("c3", "get_reservation_details", {"reservation_id": "R1", "page": 2}),
            {"role": "tool", "tool_call_id": "c3", "content": big[: len(big) // 2]},
            {"role": "assistant", "content": "R1 has 800 seats listed; all are ok."}]
    path.write_text(json.dumps([{"task_id": 1, "traj": traj}]))
    return [2, 3]


def test_replay_of_a_synthetic_trajectory(cli, tmp_path):
    try:
        import ctxbuild_providers.trajectories  # noqa: F401
    except ImportError:
        pytest.skip("ctxbuild_providers.trajectories is not importable yet (another engineer is adding it)")
    path = tmp_path / "tau.json"
    calls = synthetic_trajectory(path)
    doc = cli.json("replay", str(path), "--context-window", "16000")
    turns = doc["turns"]
    assert [t["status"] for t in turns] == ["completed", "completed"]
    assert [t["steps"] for t in turns] == calls
    first, second = turns
    assert first["trimmed"] == 0 and first["rawOutputTokens"] == first["servedOutputTokens"]
    # both reads are over the in-flight threshold: trimmed, offloaded, and the raw size is known
    assert second["trimmed"] == second["offloaded"] == 2
    assert second["rawOutputTokens"] > 4 * second["servedOutputTokens"]
    assert second["servedMax"] >= second["servedMean"] > first["servedMean"]
    hist = cli.json("history", doc["conversationId"])
    assert [m["parts"][0]["text"] for m in hist["messages"] if m["role"] == "user"] == [
        "Which user am I? My id is mia_1.", "List every seat on R1."]
    shown = cli("replay", str(path), "--context-window", "16000", "--turns", "1")
    assert shown.exit_code == 0, shown.output
    assert "1/1 completed" in shown.stdout and "tool outputs raw→served" in shown.stdout
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a trajectory"}')
    refused = cli("replay", str(bad))
    assert refused.exit_code == 2 and "unknown trajectory format" in refused.output


@pytest.mark.shared_data
def test_replay_of_a_recorded_swe_agent_run(cli, shared_data):
    """A real mini-swe-agent run (80 model calls, outputs up to tens of KB) under an 8k window."""
    pytest.importorskip("ctxbuild_providers.trajectories", reason="trajectory loading is not in this build yet")
    path = shared_data / "trajectories" / "03_miniswe_deepseek-chat_sqlfluff-1733.traj.json"
    if not path.is_file():
        pytest.skip(f"{path} absent")
    from ctxbuild_providers.trajectories import load_trajectory

    planned = [len(t.script) for t in load_trajectory(path).turns]
    doc = cli.json("replay", str(path), "--context-window", "8000")
    [turn] = doc["turns"]
    assert turn["status"] == "completed" and [turn["steps"]] == planned  # more calls than the default step limit
    assert turn["trimmed"] >= 1 and turn["rawOutputTokens"] > 2 * turn["servedOutputTokens"]
    assert turn["servedMax"] < 8000  # the messages of every request stayed inside the window


def test_the_installed_console_script(stack, all_services, tmp_path):
    """`ctxbuild` as installed (entry point), finding the server through a stack.env and its key through the
    api-key file like `make up` writes them (then the key from CTXBUILD_API_KEY)."""
    (tmp_path / "stack.env").write_text(f"CTX_ORCHESTRATION_HTTP={all_services}\n")
    (tmp_path / "api-key").write_text(stack.env["CTX_API_KEY"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CTXBUILD_URL", "CTXBUILD_API_KEY")}
    done = subprocess.run([str(CTXBUILD), "--stack-dir", str(tmp_path), "new", "--title", "from a shell"],
                          check=False, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    cid = done.stdout.strip()
    hist = subprocess.run([str(CTXBUILD), "history", cid, "--json"], check=False, capture_output=True, text=True,
                          timeout=60,
                          env={**env, "CTXBUILD_URL": all_services, "CTXBUILD_API_KEY": stack.env["CTX_API_KEY"]})
    assert hist.returncode == 0, hist.stderr
    assert json.loads(hist.stdout)["messages"] == []
    # no key anywhere: refused with a hint, exit 4
    bare = subprocess.run([str(CTXBUILD), "--stack-dir", str(tmp_path / "none"), "history", cid], check=False,
                          capture_output=True, text=True, timeout=60, env={**env, "CTXBUILD_URL": all_services})
    assert bare.returncode == 4 and "unauthenticated" in bare.stderr and "--api-key" in bare.stderr


def test_keys_create_list_revoke(stack, all_services):
    """`ctxbuild keys` with the stack's admin key: a key is shown once, works, is listed without its secret and
    stops working once revoked."""
    runner, admin = CliRunner(), ["--url", all_services, "--admin-key", stack.env["CTX_ADMIN_API_KEY"]]
    made = runner.invoke(app, [*admin, "keys", "create", "--tenant", "cli-tenant", "--name", "ci", "--rps", "7",
                               "--json"])
    assert made.exit_code == 0, made.output
    key = json.loads(made.stdout)
    assert key["key"].startswith(f"ctx_{key['keyId']}_") and key["limits"] == {"requestsPerSecond": 7}
    who = runner.invoke(app, ["--url", all_services, "--api-key", key["key"], "new", "--json"])
    assert who.exit_code == 0, who.output
    table = runner.invoke(app, [*admin, "keys", "list", "--tenant", "cli-tenant"], env={"COLUMNS": "220"})
    assert table.exit_code == 0 and key["keyId"] in table.stdout and key["key"] not in table.stdout
    listed = json.loads(runner.invoke(app, [*admin, "keys", "list", "--tenant", "cli-tenant", "--json"]).stdout)
    assert [k["keyId"] for k in listed["keys"]] == [key["keyId"]]
    gone = runner.invoke(app, [*admin, "keys", "revoke", key["keyId"], "--json"])
    assert gone.exit_code == 0 and json.loads(gone.stdout) == {"keyId": key["keyId"], "revoked": True}
    refused = runner.invoke(app, ["--url", all_services, "--api-key", key["key"], "new"])
    assert refused.exit_code == 4 and "unauthenticated" in refused.output
    # a tenant key is not an admin credential
    denied = runner.invoke(app, ["--url", all_services, "--api-key", stack.env["CTX_API_KEY"], "--admin-key",
                                 stack.env["CTX_API_KEY"], "keys", "list"])
    assert denied.exit_code == 4 and "forbidden" in denied.output
