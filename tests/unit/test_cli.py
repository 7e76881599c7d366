"""The ctxbuild CLI's pure parts: argument parsing, URL resolution, folding and rendering event sequences, the
served-request hash check, the replay summary, and the client's error mapping (httpx.MockTransport)."""

from __future__ import annotations

import hashlib
import io
import json
import socket

import httpx
import pytest
import typer
from ctxbuild_cli import render
from ctxbuild_cli.client import (
    DEFAULT_URL,
    ApiError,
    Client,
    ConnectionFailed,
    Event,
    guess_media_type,
    resolve_url,
)
from ctxbuild_cli.main import ProviderKind, app, parse_setting, provider_spec
from rich.console import Console
from typer.testing import CliRunner

runner = CliRunner()


def text_of(renderable) -> str:
    buf = io.StringIO()
    Console(file=buf, width=220, color_system=None).print(renderable)
    return buf.getvalue()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # released on close: nothing listens there


# ---------- configuration and arguments ----------
def test_url_precedence_flag_then_stack_env_then_default(tmp_path):
    assert resolve_url(None, tmp_path) == DEFAULT_URL
    (tmp_path / "stack.env").write_text("CTX_NATS_URL=nats://x\nCTX_ORCHESTRATION_HTTP=http://127.0.0.1:4711\n")
    assert resolve_url(None, tmp_path) == "http://127.0.0.1:4711"
    assert resolve_url("http://edge:8080/", tmp_path) == "http://edge:8080"


def test_media_type_by_extension_then_by_content(tmp_path):
    log = tmp_path / "service.log"
    log.write_text("2026-11-29 INFO ok\n" * 10)
    blob = tmp_path / "dump.bin2"
    blob.write_bytes(bytes(range(256)) * 4)
    edge = tmp_path / "edge.unknownext"  # a 3-byte character cut by the 8 KiB sniffing window is still text
    edge.write_bytes(b"a" * 8191 + "€".encode() + b"tail")
    assert guess_media_type(log) == "text/plain"
    assert guess_media_type(blob) == "application/octet-stream"
    assert guess_media_type(edge) == "text/plain"
    assert guess_media_type(tmp_path / "x.json") == "application/json"


def test_provider_spec_script_xor_model(tmp_path):
    script = tmp_path / "s.json"
    script.write_text(json.dumps([{"toolCalls": [{"toolName": "read_file", "input": {"filename": "a"}}]},
                                  {"text": "done"}]))
    assert provider_spec(None, None, script) == {"kind": "replay", "script": json.loads(script.read_text())}
    assert provider_spec(None, "gpt-4o-mini", None) == {"kind": "openai", "model": "gpt-4o-mini"}
    assert provider_spec(ProviderKind.anthropic, "claude-x", None) == {"kind": "anthropic", "model": "claude-x"}
    assert provider_spec(None, None, None) is None  # send refuses it; regenerate reuses the turn's provider
    for kind, model, path in ((None, "m", script), (ProviderKind.openai, None, script),
                              (ProviderKind.replay, None, None), (ProviderKind.openai, None, None)):
        with pytest.raises(typer.BadParameter):
            provider_spec(kind, model, path)


def test_script_file_forms_and_rejections(tmp_path):
    wrapped = tmp_path / "w.json"
    tools = [{"name": "bash", "description": "", "inputSchema": {"type": "object"}}]
    wrapped.write_text(json.dumps({"script": [{"text": "hi"}], "tools": tools}))
    assert provider_spec(None, None, wrapped) == {"kind": "replay", "script": [{"text": "hi"}], "tools": tools}
    bad = {"not-json.json": "{", "empty.json": "[]", "stepless.json": '[{"foo": 1}]', "scalar.json": "3"}
    for name, content in bad.items():
        (tmp_path / name).write_text(content)
        with pytest.raises(typer.BadParameter):
            provider_spec(None, None, tmp_path / name)


def test_settings_values_are_json_when_they_parse():
    assert parse_setting("truncateThreshold=6000") == ("truncateThreshold", 6000)
    assert parse_setting("compressEnabled=false") == ("compressEnabled", False)
    assert parse_setting("summarizer=llm") == ("summarizer", "llm")
    with pytest.raises(typer.BadParameter):
        parse_setting("novalue")


@pytest.mark.parametrize("args", [
    ["send", "conv_x", "hi", "--script", "{script}", "--model", "gpt"],   # two providers
    ["send", "conv_x", "hi"],                                             # no provider
    ["send", "conv_x", "hi", "--model", "m", "--attach", "{missing}"],    # attachment not there
    ["send", "conv_x", "   ", "--model", "m"],                            # empty message
    ["new", "--setting", "oops"],
    ["new", "--context-window", "0"],
    ["request", "conv_x", "turn_x", "0"],
    ["send", "conv_x", "hi", "--provider", "gemini", "--model", "m"],
])
def test_usage_errors_exit_2_before_any_request(tmp_path, args):
    script = tmp_path / "s.json"
    script.write_text('[{"text": "x"}]')
    argv = ["--url", f"http://127.0.0.1:{closed_port()}"] + [
        a.format(script=script, missing=tmp_path / "nope.txt") for a in args]
    result = runner.invoke(app, argv)
    # 3 would mean it tried the (closed) server first
    assert result.exit_code == 2, result.output


def test_unreachable_server_is_exit_3_with_a_clear_message():
    result = runner.invoke(app, ["--url", f"http://127.0.0.1:{closed_port()}", "new"])
    assert result.exit_code == 3
    assert "cannot reach the orchestration service" in result.stderr and "make up" in result.stderr


def test_stack_env_from_environment_variable(tmp_path):
    port = closed_port()
    (tmp_path / "stack.env").write_text(f"CTX_ORCHESTRATION_HTTP=http://127.0.0.1:{port}\n")
    result = runner.invoke(app, ["history", "conv_x"], env={"CTXBUILD_STACK_DIR": str(tmp_path), "CTXBUILD_URL": ""})
    assert result.exit_code == 3 and f"127.0.0.1:{port}" in result.stderr


# ---------- a turn's events → the live view ----------
def ev(version: int, type_: str, **data) -> Event:
    return Event(type_, version, {"turnId": "turn_1", **data})


OFFLOAD = {"mode": "offloaded", "uri": "context://vfs/vfs_0123456789abcdef.txt", "sha256": "a" * 64,
           "totalChars": 30_000, "totalLines": 400}
TURN = [
    ev(1, "TurnQueued", conversationId="conv_1"),
    ev(2, "TurnStarted", conversationId="conv_1", userMessageId="msg_u"),
    ev(3, "CompactionDecided", phase="turn-start", status="skipped", reason="under-trigger", preTokens=900),
    ev(4, "StepServed", step=1, servedTokens=1_234, messagesServed=2, requestHash="f" * 64,
       usage={"inputTokens": 1_500, "outputTokens": 40, "cacheReadTokens": 1_024}),
    ev(5, "ToolCallRequested", step=1, toolCallId="call_1_1", toolName="read_file", input={"filename": "a.log"}),
    ev(6, "ToolCallRequested", step=1, toolCallId="call_1_2",
       toolName="mcp__time__get_current_time_0123456789abcdef0123", input={}),
    ev(7, "ToolResultRecorded", step=1, toolCallId="call_1_1", toolName="read_file", trimmed=True,
       output={"type": "text", "value": "excerpt … <persisted-output>"}, offload=OFFLOAD),
    ev(8, "ToolResultRecorded", step=1, toolCallId="call_1_2",
       toolName="mcp__time__get_current_time_0123456789abcdef0123", trimmed=False,
       output={"type": "text", "value": "2026-11-30T10:00:00Z"}),
    ev(9, "CompactionDecided", phase="in-loop", status="done", preTokens=13_000, postTokens=2_100, step=2),
    ev(10, "InLoopFoldRecorded", step=2, consumedCount=3, compactedPrefix=[]),
    ev(11, "StepServed", step=2, servedTokens=2_500, messagesServed=3, requestHash="e" * 64,
       usage={"inputTokens": 2_600, "outputTokens": 9}),
    ev(12, "TurnCompleted", steps=2, messageIds=["msg_a1", "msg_t1", "msg_a2"]),
]


def test_fold_puts_each_event_on_its_step():
    view = render.fold("turn_1", TURN)
    assert view.status == "completed" and view.message_ids == ["msg_a1", "msg_t1", "msg_a2"]
    one, two = view.served_steps
    assert one.compaction == ["turn-start: skipped (under-trigger)"] and one.folds == 0
    assert [c.name for c in one.calls] == ["read_file", "mcp__time__get_current_time_0123456789abcdef0123"]
    assert (one.trimmed, one.offloaded) == (1, 1)
    assert two.compaction == ["in-loop: folded 13,000→2,100"] and two.folds == 1
    assert view.last_version == 12


def test_live_view_renders_steps_tools_trims_and_compaction():
    shown = text_of(render.render_turn(render.fold("turn_1", TURN)))
    assert "1,234" in shown and "2,500" in shown
    assert "1,500/40 (cache r1,024)" in shown
    assert "read_file ✂→blob, mcp:time/get_current_time" in shown
    assert "turn-start: skipped (under-trigger)" in shown and "in-loop: folded 13,000→2,100" in shown
    assert "completed — 2 model call(s)" in shown and "ffffffffffff" in shown


def test_live_tail_keeps_the_newest_steps():
    shown = text_of(render.render_turn(render.fold("turn_1", TURN), tail=1))
    assert "1 earlier step(s)" in shown and "2,500" in shown and "1,234" not in shown


def test_a_running_turn_shows_pending_parts_and_a_failure_its_reason():
    partial = render.fold("turn_1", TURN[:6])
    shown = text_of(render.render_turn(partial))
    assert partial.status == "running" and "read_file …" in shown
    failed = render.fold("turn_1", [*TURN[:4], ev(5, "TurnResumed"), ev(6, "TurnAbortRequested", reason="user"),
                                    ev(7, "TurnFailed", code="aborted", message="stopped by the client")])
    shown = text_of(render.render_turn(failed))
    assert failed.status == "failed" and failed.failure == {"code": "aborted", "message": "stopped by the client"}
    assert "failed (resumed (v5); abort requested: user) — aborted: stopped by the client" in shown


def test_final_text_is_the_turns_last_assistant_text():
    messages = [{"id": "msg_u", "role": "user", "parts": [{"type": "text", "text": "q"}]},
                {"id": "msg_a1", "role": "assistant", "parts": [{"type": "text", "text": "let me look"},
                                                                  {"type": "tool-call", "toolCallId": "c"}]},
                {"id": "msg_t1", "role": "tool", "parts": []},
                {"id": "msg_a2", "role": "assistant", "parts": [{"type": "text", "text": "the answer"}]},
                {"id": "msg_other", "role": "assistant", "parts": [{"type": "text", "text": "another turn"}]}]
    assert render.final_text(messages, ["msg_a1", "msg_t1", "msg_a2"]) == "the answer"
    assert render.final_text(messages, ["msg_a1"]) == "let me look"
    assert render.final_text(messages, []) == ""


def test_short_tool_names():
    assert render.short_tool_name("mcp__time__get_current_time_0123456789abcdef0123") == "mcp:time/get_current_time"
    assert render.short_tool_name("read_file") == "read_file"


# ---------- history ----------
def msg(mid, parent, role="assistant", **kw):
    return {"id": mid, "parentId": parent, "role": role, "parts": [{"type": "text", "text": mid}], **kw}


def test_history_rows_keep_a_chain_flat_and_indent_branches():
    rows = render.history_rows([msg("u1", None, "user"), msg("a1", "u1"), msg("a1b", "u1"), msg("u2", "a1", "user"),
                                msg("a2", "u2")])
    assert [(d, m["id"]) for d, m in rows] == [(0, "u1"), (0, "a1"), (0, "u2"), (0, "a2"), (1, "a1b")]
    deep = [msg("m0", None)] + [msg(f"m{i}", f"m{i - 1}") for i in range(1, 5000)]
    assert [d for d, _ in render.history_rows(deep)] == [0] * 5000  # no recursion limit, no indentation creep


def test_history_render_describes_parts():
    hist = {"conversationId": "conv_1",
            "attachments": [{"handle": "a.log", "displayName": "a.log", "mediaType": "text/plain", "size": 30_000,
                             "sha256": "b" * 64}],
            "messages": [{"id": "u", "parentId": None, "role": "user", "parts": [{"type": "text", "text": "read it"}]},
                         {"id": "a", "parentId": "u", "role": "assistant", "turnId": "turn_1",
                          "parts": [{"type": "tool-call", "toolCallId": "call_1_1", "toolName": "read_file",
                                     "input": {"filename": "a.log"}}]},
                         {"id": "t", "parentId": "a", "role": "tool", "turnId": "turn_1",
                          "parts": [{"type": "tool-result", "toolCallId": "call_1_1", "toolName": "read_file",
                                     "output": {"type": "text", "value": "x" * 4_000}, "offload": OFFLOAD}]}]}
    shown = text_of(render.render_history({**hist, "branches": {"a": ["a_old", "a"]}}))
    assert "[branch 2/2; other: a_old]" in shown
    assert "a.log" in shown and "30,000" in shown
    assert '→ read_file({"filename": "a.log"}) #call_1_1' in shown
    assert "← read_file: 4,000 chars [trimmed from 30,000 chars, full text context://vfs/vfs_0123456789abcdef.txt]" \
        in shown


# ---------- the served request ----------
def test_request_hash_matches_body_or_canonical_rendering_like_the_provider():
    from ctxbuild_providers import ModelRequest, ToolSpec

    tools = [ToolSpec("read_file", "Read an attachment — ünïcode", {"type": "object"})]
    messages = [{"id": "m1", "role": "user", "parts": [{"type": "text", "text": "héllo"}]}]
    req = ModelRequest("replay", "sys", messages, tools)
    raw = req.render()
    doc = json.loads(raw)
    assert render.hash_match(raw, doc, req.digest()) == "body"
    pretty = json.dumps(doc, indent=2).encode()  # another server formatting: the canonical rendering still matches
    assert render.hash_match(pretty, doc, req.digest()) == "re-rendered"
    assert render.render_request_bytes(doc) == raw  # pinned to ModelRequest.render
    assert render.hash_match(raw, {**doc, "system": "changed"}, hashlib.sha256(b"other").hexdigest()) is None
    assert render.hash_match(raw, doc, None) is None


def test_request_summary_counts_roles_tools_and_tokens():
    doc = {"model": "replay", "system": "You are careful.",
           "tools": [{"name": "read_file", "description": "d", "inputSchema": {"type": "object"}}],
           "messages": [{"id": "u", "role": "user", "parts": [{"type": "text", "text": "read a.log please"}]},
                        {"id": "a", "role": "assistant", "parts": [{"type": "tool-call", "toolCallId": "c",
                                                                    "toolName": "read_file", "input": {}}]},
                        {"id": "t", "role": "tool", "parts": [{"type": "tool-result", "toolCallId": "c",
                                                               "toolName": "read_file",
                                                               "output": {"type": "text", "value": "data " * 50}}]}]}
    s = render.request_summary(doc)
    assert s["roles"] == {"user": 1, "assistant": 1, "tool": 1} and s["tools"] == ["read_file"]
    assert s["systemTokens"] > 0 and s["messageTokens"] == sum(m["tokens"] for m in s["messages"])
    assert s["messages"][2]["tokens"] > s["messages"][0]["tokens"]
    served = {"step": 1, "servedTokens": s["messageTokens"], "requestHash": s["sha256"]}
    shown = text_of(render.render_request(s, served, "re-rendered"))
    assert "matches StepServed (re-rendered)" in shown and "user 1, assistant 1, tool 1" in shown
    assert "DOES NOT match" in text_of(render.render_request(s, served, None))


# ---------- replay summary ----------
def test_turn_summary_served_mean_max_raw_and_trims():
    from ctxbuild_codec.tokens import count_output

    view = render.fold("turn_1", TURN)
    mcp_tokens = count_output({"type": "text", "value": "2026-11-30T10:00:00Z"})
    known = render.turn_summary(view, {"call_1_1": 7_000})
    assert (known["steps"], known["servedMean"], known["servedMax"]) == (2, 1_867, 2_500)
    assert known["rawOutputTokens"] == 7_000 + mcp_tokens
    assert known["servedOutputTokens"] < known["rawOutputTokens"]
    assert (known["trimmed"], known["offloaded"], known["compactions"], known["status"]) == (1, 1, 1, "completed")
    assert render.turn_summary(view, None)["rawOutputTokens"] is None  # a trimmed output we could not read back
    table = text_of(render.render_replay_summary([known, render.turn_summary(view, None)], "replay"))
    assert f"{7_000 + mcp_tokens:,}→" in table and "n/a→" in table and "2/2 completed" in table


def test_recorded_outputs_follow_step_and_call_order():
    script = [{"toolCalls": [{"toolName": "read_file", "input": {}, "output": {"type": "text", "value": "A" * 9}},
                             {"toolName": "mcp:time/get_current_time", "input": {}}]},  # a live tool: no record
              {"text": "done"}]
    assert render.recorded_outputs(render.fold("turn_1", TURN), script) == {
        "call_1_1": {"type": "text", "value": "A" * 9}}


def test_full_output_tokens_accepts_the_result_endpoint_shapes():
    from ctxbuild_codec.tokens import count_text

    text = "line of text\n" * 100
    assert render.full_output_tokens({"output": {"type": "text", "value": text}, "source": "offloaded"}) \
        == count_text(text)
    assert render.full_output_tokens({"type": "text", "value": text}) == count_text(text)


# ---------- client error mapping (MockTransport) ----------
def mock_client(handler) -> Client:
    return Client("http://ctx.test", transport=httpx.MockTransport(handler))


def test_server_error_body_becomes_a_typed_api_error():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"code": "not-found", "message": "conversation conv_x not found",
                                         "retryable": False})

    with pytest.raises(ApiError) as info:
        mock_client(handler).messages("conv_x")
    e = info.value
    assert (e.status, e.code, e.message, e.retryable) == (404, "not-found", "conversation conv_x not found", False)
    assert e.path == "/v1/conversations/conv_x/messages" and not e.endpoint_missing


def test_validation_errors_unknown_routes_and_non_json_bodies():
    answers = {
        "/v1/conversations": httpx.Response(422, json={"detail": [
            {"loc": ["body", "settings", "contextWindow"], "msg": "Input should be greater than 0"}]}),
        "/v1/conversations/c/turns/t/abort": httpx.Response(404, json={"detail": "Not Found"}),
        "/v1/conversations/c/turns/t/regenerate": httpx.Response(405, json={"detail": "Method Not Allowed"}),
        "/v1/conversations/c/messages": httpx.Response(502, text="<html>bad gateway</html>"),
    }
    client = mock_client(lambda r: answers[r.url.path])
    with pytest.raises(ApiError) as info:
        client.create_conversation(settings={"contextWindow": 0})
    assert info.value.code == "invalid-payload" and "body.settings.contextWindow" in info.value.message
    for call in (lambda: client.abort("c", "t"), lambda: client.regenerate("c", "t")):
        with pytest.raises(ApiError) as info:
            call()
        assert info.value.endpoint_missing
    with pytest.raises(ApiError) as info:
        client.messages("c")
    assert (info.value.code, info.value.retryable) == ("http-502", True) and "bad gateway" in info.value.message


def test_transport_failures_become_connection_failed():
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    client = mock_client(handler)
    with pytest.raises(ConnectionFailed, match=r"cannot reach the orchestration service at http://ctx\.test"):
        client.create_conversation()
    with pytest.raises(ConnectionFailed):  # the first connect of an event stream fails fast too
        list(client.events("c", "t", sleep=lambda s: None))


def test_event_stream_errors():
    answers = {
        "/v1/conversations/c/turns/missing/events": httpx.Response(
            404, json={"code": "not-found", "message": "turn missing not found in conversation c", "retryable": False}),
        "/v1/conversations/c/turns/html/events": httpx.Response(200, text="<html/>",
                                                                headers={"content-type": "text/html"}),
    }
    client = mock_client(lambda r: answers[r.url.path])
    with pytest.raises(ApiError) as info:
        list(client.events("c", "missing"))
    assert info.value.code == "not-found"
    with pytest.raises(ApiError) as info:
        list(client.events("c", "html"))
    assert info.value.code == "bad-response"


def test_ids_are_sent_as_single_path_segments():
    seen: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.raw_path)
        return httpx.Response(404, json={"code": "not-found", "message": "no such conversation", "retryable": False})

    with pytest.raises(ApiError) as info:
        mock_client(handler).messages("conv/../x?y")
    assert seen == [b"/v1/conversations/conv%2F..%2Fx%3Fy/messages"] and info.value.code == "not-found"


# ---------- following a turn through faults (issue #16: the CLI follows a resumed turn) ----------
def _sse(*events: tuple[str, int, dict]) -> httpx.Response:
    body = "".join(f"event: {t}\nid: {v}\ndata: {json.dumps(d)}\n\n" for t, v, d in events)
    return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})


def test_follow_outlasts_any_number_of_dropped_streams_while_the_server_answers():
    """Twenty dropped streams (the edge answering 503 / cutting the stream) while the turn runs, then the turn
    completes while the stream is down: every event once, in order, ending with TurnCompleted."""
    log = [{"type": "TurnStarted", "version": 2, "data": {}}]
    calls = {"stream": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/events"):
            calls["stream"] += 1
            if calls["stream"] == 1:
                return _sse(("TurnQueued", 1, {}))
            if calls["stream"] < 20:
                return httpx.Response(503, json={"code": "unavailable", "message": "persistence away",
                                                 "retryable": True})
            raise httpx.ConnectError("edge restarting", request=request)
        if calls["stream"] >= 21:  # the turn completed meanwhile; the edge is back
            return httpx.Response(200, json={"status": "completed", "events": [
                {"type": "TurnQueued", "version": 1, "data": {}}, *log,
                {"type": "StepServed", "version": 3, "data": {"step": 1}},
                {"type": "TurnCompleted", "version": 4, "data": {}}]})
        if calls["stream"] == 20:
            calls["stream"] += 1
            raise httpx.ConnectError("edge restarting", request=request)
        return httpx.Response(200, json={"status": "running", "events": [
            {"type": "TurnQueued", "version": 1, "data": {}}, *log]})

    got = list(mock_client(handler).events("c", "t", sleep=lambda s: None))
    assert [(e.type, e.id) for e in got] == [("TurnQueued", 1), ("TurnStarted", 2), ("StepServed", 3),
                                             ("TurnCompleted", 4)]


def test_follow_gives_up_only_when_the_server_stays_unreachable():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/events") and request.headers.get("last-event-id") is None:
            return _sse(("TurnQueued", 1, {}))
        raise httpx.ConnectError("connection refused", request=request)

    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    with pytest.raises(ConnectionFailed, match=r"unreachable .* times in a row over 120s"):
        list(mock_client(handler).events("c", "t", sleep=sleep, clock=lambda: now[0]))
    assert now[0] >= 120  # an edge being restarted had two minutes to come back


def test_follow_ends_on_204_and_on_a_turn_log_that_ended():
    """The SSE endpoint answers 204 when the turn ended and Last-Event-ID is its last event: nothing more to follow.
    A stream that keeps ending empty while the turn log shows the turn ended (its terminal event seen) ends too."""
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(204)

    assert list(mock_client(handler).events("c", "t", last_event_id=2, sleep=lambda s: None)) == []

    def empty(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/events"):
            return httpx.Response(200, text="", headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"status": "completed", "events": [
            {"type": "TurnQueued", "version": 1, "data": {}}, {"type": "TurnCompleted", "version": 2, "data": {}}]})

    assert list(mock_client(empty).events("c", "t", last_event_id=2, sleep=lambda s: None)) == []
    got = list(mock_client(empty).events("c", "t", last_event_id=1, sleep=lambda s: None))
    assert [(e.type, e.id) for e in got] == [("TurnCompleted", 2)]
