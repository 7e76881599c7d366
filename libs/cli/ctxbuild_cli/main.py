"""The `ctxbuild` command line (typer + rich) over the orchestration HTTP API.

Commands are thin: parse, call `client.Client`, hand the answer to `render`. Exit codes: 0 ok · 1 the turn
failed (or a served request's hash did not match) · 2 usage error · 3 the server could not be reached ·
4 the server refused the request (its error code and message are printed).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.syntax import Syntax

from . import render
from .client import ApiError, Client, ConnectionFailed, resolve_api_key, resolve_url, stack_admin_key

EXIT_TURN_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_REFUSED = 1, 2, 3, 4

app = typer.Typer(help="ctxbuild: conversations and agent turns on a running ctxbuild stack (make up).",
                  epilog="Exit codes: 0 ok, 1 turn failed or hash mismatch, 2 usage, 3 server unreachable, "
                         "4 server refused the request.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_show_locals=False)
out = Console()
err = Console(stderr=True, soft_wrap=True)  # messages keep their lines (paths, ids) whole


@dataclass(frozen=True)
class Settings:
    url: str
    timeout: float
    api_key: str | None = None
    admin_key: str | None = None


class ProviderKind(StrEnum):
    openai = "openai"
    anthropic = "anthropic"
    replay = "replay"


class McpMode(StrEnum):
    manual = "manual"
    auto = "auto"
    disabled = "disabled"


JsonFlag = Annotated[bool, typer.Option("--json", help="machine-readable JSON on stdout instead of tables")]
ProviderOpt = Annotated[ProviderKind | None, typer.Option(
    "--provider", help="who decides: openai / anthropic need --model; replay needs --script", case_sensitive=False)]
ModelOpt = Annotated[str | None, typer.Option("--model", "-m", help="model name (default provider: openai)")]
ScriptOpt = Annotated[Path | None, typer.Option(
    "--script", exists=True, dir_okay=False, readable=True,
    help="replay script JSON: a list of steps, or {\"script\": [...], \"tools\": [...]}")]
FollowOpt = Annotated[bool, typer.Option("--follow/--no-follow", help="stream the turn's progress until it ends")]
MaxStepsOpt = Annotated[int | None, typer.Option("--max-steps", min=1,
                                                 help="model calls the turn may make (default: the server's)")]


@app.callback()
def root(ctx: typer.Context,
         url: Annotated[str | None, typer.Option(
             "--url", envvar="CTXBUILD_URL", show_envvar=True,
             help="orchestration base URL (default: CTX_ORCHESTRATION_HTTP from <stack-dir>/stack.env, "
                  "else http://127.0.0.1:8080)")] = None,
         stack_dir: Annotated[Path, typer.Option("--stack-dir", envvar="CTXBUILD_STACK_DIR",
                                                 help="the local stack's state folder")] = Path(".stack"),
         api_key: Annotated[str | None, typer.Option(
             "--api-key", envvar="CTXBUILD_API_KEY", show_envvar=True,
             help="the API key sent with every call (default: the local stack's <stack-dir>/api-key)")] = None,
         admin_key: Annotated[str | None, typer.Option(
             "--admin-key", envvar="CTXBUILD_ADMIN_KEY", show_envvar=True,
             help="an admin credential for `keys` (default: the local stack's CTX_ADMIN_API_KEY, else --api-key)")
         ] = None,
         timeout: Annotated[float, typer.Option(min=0.1, help="seconds per HTTP request")] = 30.0) -> None:
    ctx.obj = Settings(resolve_url(url, stack_dir), timeout, resolve_api_key(api_key, stack_dir),
                       admin_key or stack_admin_key(stack_dir))


# ---------- plumbing ----------
def fail(message: str, code: int) -> NoReturn:
    err.print(f"[bold red]error:[/bold red] {message}", highlight=False)
    raise typer.Exit(code)


@contextmanager
def api(ctx: typer.Context, *, admin: bool = False) -> Iterator[Client]:
    """A client whose typed errors become one clear line on stderr and an exit code."""
    settings: Settings = ctx.obj
    key = (settings.admin_key or settings.api_key) if admin else settings.api_key
    try:
        with Client(settings.url, api_key=key, timeout=settings.timeout) as client:
            yield client
    except ConnectionFailed as exc:
        fail(f"{escape(str(exc))}\n  start the stack with `make up`, or point --url / CTXBUILD_URL at it",
             EXIT_UNREACHABLE)
    except ApiError as exc:
        hint = " (this server does not have that endpoint: is it older than this CLI?)" if exc.endpoint_missing else ""
        if exc.status == 401:
            hint = (" (pass --api-key or set CTXBUILD_API_KEY; `make up` writes the local stack's key to "
                    "<stack-dir>/api-key)")
        fail(f"{exc.method} {escape(exc.path)} → HTTP {exc.status} [bold]{escape(exc.code)}[/bold]: "
             f"{escape(exc.message)}{hint}",
             EXIT_REFUSED)


def emit_json(doc: Any) -> None:
    typer.echo(json.dumps(doc, ensure_ascii=False, indent=2))


def parse_setting(item: str) -> tuple[str, Any]:
    """`KEY=VALUE` → (KEY, VALUE as JSON when it parses: numbers, booleans, lists; else the string)."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise typer.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="'--setting'")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def load_script(path: Path) -> dict[str, Any]:
    """A replay spec from a script file; a clear usage error for anything a replay cannot play."""
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise typer.BadParameter(f"{path} is not JSON ({exc})", param_hint="'--script'") from exc
    script, tools = (doc, None) if isinstance(doc, list) else (
        (doc.get("script"), doc.get("tools")) if isinstance(doc, dict) else (None, None))
    if not isinstance(script, list) or not script:
        raise typer.BadParameter(f"{path}: expected a non-empty list of steps (or {{\"script\": [...]}})",
                                 param_hint="'--script'")
    for i, step in enumerate(script, 1):
        if not isinstance(step, dict) or not ("text" in step or "toolCalls" in step):
            raise typer.BadParameter(f"{path}: step {i} needs \"text\" or \"toolCalls\"", param_hint="'--script'")
    spec: dict[str, Any] = {"kind": "replay", "script": script}
    if tools is not None:
        spec["tools"] = tools
    return spec


def provider_spec(kind: ProviderKind | None, model: str | None, script: Path | None) -> dict[str, Any] | None:
    """--script (replay) xor --model (openai unless --provider says anthropic); None when none was given."""
    if script is not None:
        if model or kind not in (None, ProviderKind.replay):
            raise typer.BadParameter("--script plays a replay; it does not go with --model or --provider "
                                     f"{kind.value if kind else ''}".rstrip(), param_hint="'--script'")
        return load_script(script)
    if kind == ProviderKind.replay:
        raise typer.BadParameter("the replay provider needs --script FILE.json", param_hint="'--provider'")
    if model:
        return {"kind": (kind or ProviderKind.openai).value, "model": model}
    if kind is not None:
        raise typer.BadParameter(f"--provider {kind.value} needs --model M", param_hint="'--model'")
    return None


def follow(client: Client, cid: str, tid: str, *, json_mode: bool, after: int | None = None,
           title: str | None = None) -> render.TurnView:
    view = render.TurnView(tid)
    try:
        if json_mode or not out.is_terminal:  # piped: no redraws, the table once at the end
            for ev in client.events(cid, tid, last_event_id=after):
                view.apply(ev)
            if not json_mode:
                out.print(render.render_turn(view, title))
        else:
            with Live(render.render_turn(view, title), console=out, refresh_per_second=8) as live:
                for ev in client.events(cid, tid, last_event_id=after):
                    tail = max(3, out.size.height - 10)  # header, caption and the prompt stay on screen
                    live.update(render.render_turn(view.apply(ev), title, tail=tail))
                live.update(render.render_turn(view, title))  # the last frame holds every step
    except KeyboardInterrupt:
        err.print(f"\nstopped following; the turn keeps running on the server.\n"
                  f"  follow it:  ctxbuild watch {cid} {tid}\n  stop it:    ctxbuild abort {cid} {tid}")
        raise typer.Exit(130) from None
    return view


def finish(client: Client, cid: str, view: render.TurnView, json_mode: bool, extra: dict[str, Any]) -> None:
    """After the terminal event: the answer (read from the conversation), JSON or text, and the exit code."""
    text = ""
    if view.status == "completed":
        text = render.final_text(client.messages(cid).get("messages", []), view.message_ids)
    if json_mode:
        emit_json({"conversationId": cid, **extra, **view.as_dict(), "text": text,
                   "events": [e.as_dict() for e in view.events]})
    elif text:
        out.rule("answer", align="left")
        out.print(text, markup=False, highlight=False)
    if view.status == "failed":
        if not json_mode:
            f = view.failure or {}
            err.print(f"[bold red]turn failed:[/bold red] {escape(str(f.get('code')))}: "
                      f"{escape(str(f.get('message')))}", highlight=False)
        raise typer.Exit(EXIT_TURN_FAILED)


# ---------- commands ----------
@app.command()
def new(ctx: typer.Context,
        title: Annotated[str | None, typer.Option(help="conversation title")] = None,
        context_window: Annotated[int | None, typer.Option(min=1, help="model context window in tokens")] = None,
        mcp_server: Annotated[list[str] | None, typer.Option(
            "--mcp-server", help="MCP server id offered to the model (repeatable)")] = None,
        mcp_mode: Annotated[McpMode | None, typer.Option(help="how MCP tools are chosen")] = None,
        setting: Annotated[list[str] | None, typer.Option(
            "--setting", "-s", help="any other conversation setting, KEY=VALUE (JSON values), repeatable")] = None,
        json_out: JsonFlag = False) -> None:
    """Start a conversation; prints its id."""
    settings: dict[str, Any] = dict(parse_setting(s) for s in setting or [])
    if context_window is not None:
        settings["contextWindow"] = context_window
    if mcp_server:
        settings["mcpServers"] = mcp_server
    if mcp_mode is not None:
        settings["mcpMode"] = mcp_mode.value
    with api(ctx) as client:
        conv = client.create_conversation(title, settings)
    if json_out:
        emit_json(conv)
    else:
        typer.echo(conv["id"])


@app.command()
def send(ctx: typer.Context,
         conversation: Annotated[str, typer.Argument(help="conversation id")],
         text: Annotated[str, typer.Argument(help="the user message")],
         attach: Annotated[list[Path] | None, typer.Option(
             "--attach", "-a", exists=True, dir_okay=False, readable=True,
             help="file to attach first (repeatable)")] = None,
         model: ModelOpt = None, provider: ProviderOpt = None, script: ScriptOpt = None,
         max_steps: MaxStepsOpt = None, follow_: FollowOpt = True, json_out: JsonFlag = False) -> None:
    """Send a message (with attachments) and follow the turn live: steps, tokens served, tool calls, trims,
    compaction, then the answer. Exit 1 when the turn fails."""
    spec = provider_spec(provider, model, script)  # usage errors before anything is uploaded
    if spec is None:
        raise typer.BadParameter("say who decides: --script FILE.json (replay) or --model M "
                                 "[--provider openai|anthropic]", param_hint="'--model'")
    if not text.strip():
        raise typer.BadParameter("the message is empty", param_hint="'TEXT'")
    with api(ctx) as client:
        attached = []
        for path in attach or []:
            a = client.upload_attachment(conversation, path)
            attached.append(a)
            if not json_out:
                err.print(f"attached [bold]{escape(a['handle'])}[/bold] ({escape(a['mediaType'])}, "
                          f"{a['size']:,} bytes, sha256 {a['sha256'][:12]})", highlight=False)
        turn = client.start_turn(conversation, text, spec, max_steps)
        tid = turn["turnId"]
        if not follow_:
            if json_out:
                emit_json({"conversationId": conversation, "attachments": attached, **turn})
            else:
                typer.echo(tid)
            return
        if not json_out:
            err.print(f"turn {tid} ({spec['kind']}{' ' + spec['model'] if 'model' in spec else ''})",
                      highlight=False)
        view = follow(client, conversation, tid, json_mode=json_out)
        finish(client, conversation, view, json_out,
               {"userMessageId": turn.get("userMessageId"), "attachments": attached})


@app.command()
def watch(ctx: typer.Context,
          conversation: Annotated[str, typer.Argument(help="conversation id")],
          turn: Annotated[str, typer.Argument(help="turn id")],
          after: Annotated[int | None, typer.Option(min=0, help="start after this event version")] = None,
          json_out: JsonFlag = False) -> None:
    """Follow an existing turn (a dropped connection is resumed with Last-Event-ID)."""
    with api(ctx) as client:
        log = render.events_from_log(client.turn(conversation, turn).get("events", []))
        end = next((e for e in log if e.terminal), None)
        if end is not None and after is not None and after >= end.id:
            # nothing after `after` will ever come: the turn ended at end.id
            view = render.fold(turn, [end])
            if not json_out:
                err.print(f"turn {turn} already ended at version {end.id}", highlight=False)
                out.print(render.render_turn(view))
            finish(client, conversation, view, json_out, {})
            return
        view = follow(client, conversation, turn, json_mode=json_out, after=after)
        finish(client, conversation, view, json_out, {})


@app.command()
def abort(ctx: typer.Context,
          conversation: Annotated[str, typer.Argument(help="conversation id")],
          turn: Annotated[str, typer.Argument(help="turn id")],
          reason: Annotated[str | None, typer.Option(help="recorded with the request")] = None,
          json_out: JsonFlag = False) -> None:
    """Ask the server to stop a running turn (it ends with TurnFailed at its next step boundary)."""
    with api(ctx) as client:
        reply = client.abort(conversation, turn, reason)
    if json_out:
        emit_json({"conversationId": conversation, "turnId": turn, **reply})
    else:
        typer.echo(f"abort requested for {turn}")


@app.command()
def regenerate(ctx: typer.Context,
               conversation: Annotated[str, typer.Argument(help="conversation id")],
               turn: Annotated[str, typer.Argument(help="the turn to answer again")],
               model: ModelOpt = None, provider: ProviderOpt = None, script: ScriptOpt = None,
               max_steps: MaxStepsOpt = None, follow_: FollowOpt = True, json_out: JsonFlag = False) -> None:
    """Answer a turn's user message again (a sibling branch) and follow the new turn. Without --model or
    --script the server reuses the turn's own provider."""
    spec = provider_spec(provider, model, script)  # None: the server reuses the turn's provider
    with api(ctx) as client:
        reply = client.regenerate(conversation, turn, spec, max_steps)
        tid = reply["turnId"]
        if not follow_:
            if json_out:
                emit_json({"conversationId": conversation, **reply})
            else:
                typer.echo(tid)
            return
        view = follow(client, conversation, tid, json_mode=json_out)
        finish(client, conversation, view, json_out, {"regenerated": turn})


@app.command()
def history(ctx: typer.Context,
            conversation: Annotated[str, typer.Argument(help="conversation id")],
            branches: Annotated[bool, typer.Option(
                "--branches", help="name the other branches (regenerated answers) of each message")] = False,
            json_out: JsonFlag = False) -> None:
    """The conversation's attachments and messages on its current path (the newest branch)."""
    with api(ctx) as client:
        hist = client.messages(conversation, branches=branches)
    if json_out:
        emit_json(hist)
    else:
        out.print(render.render_history({"conversationId": conversation, **hist}))


@app.command()
def request(ctx: typer.Context,
            conversation: Annotated[str, typer.Argument(help="conversation id")],
            turn: Annotated[str, typer.Argument(help="turn id")],
            step: Annotated[int, typer.Argument(min=1, help="model call number within the turn (1-based)")],
            full: Annotated[bool, typer.Option("--full", help="the whole request as indented JSON")] = False,
            raw: Annotated[bool, typer.Option("--raw", help="the request body exactly as served")] = False,
            json_out: JsonFlag = False) -> None:
    """The exact request the model saw on one step: a summary (roles, tokens, tools) and whether its sha256
    matches the StepServed requestHash. Exit 1 on a mismatch."""
    with api(ctx) as client:
        served = client.served_request(conversation, turn, step)
        events = render.events_from_log(client.turn(conversation, turn).get("events", []))
    if raw:  # byte for byte (no added newline): `ctxbuild request … --raw | sha256sum` is the requestHash
        stdout = typer.get_binary_stream("stdout")
        stdout.write(served.raw)
        stdout.flush()
        return
    step_served = next((e.data for e in events if e.type == "StepServed" and e.data.get("step") == step), None)
    match = render.hash_match(served.raw, served.doc, step_served and step_served.get("requestHash"))
    mismatch = step_served is not None and match is None
    if json_out:
        emit_json({"conversationId": conversation, "turnId": turn, "step": step,
                   "requestHash": step_served and step_served.get("requestHash"), "match": match,
                   "summary": render.request_summary(served.doc), "request": served.doc})
    elif full:
        out.print(Syntax(json.dumps(served.doc, ensure_ascii=False, indent=2), "json", word_wrap=True))
    else:
        out.print(render.render_request(render.request_summary(served.doc), step_served, match))
    if mismatch:
        err.print("[bold red]the served request does not hash to the recorded requestHash[/bold red]")
        raise typer.Exit(EXIT_TURN_FAILED)


@app.command()
def result(ctx: typer.Context,
           conversation: Annotated[str, typer.Argument(help="conversation id")],
           message: Annotated[str, typer.Argument(help="the tool message's id (see `ctxbuild history`)")],
           call: Annotated[str, typer.Argument(help="the tool call id")],
           json_out: JsonFlag = False) -> None:
    """A tool result in full, read back from the blob store (what trimming kept out of the context)."""
    with api(ctx) as client:
        res = client.result(conversation, message, call)
    output = res.get("output") if isinstance(res.get("output"), dict) else res
    if json_out:
        emit_json(res)
        return
    if res.get("source"):
        gone = f"; blobs gone: {', '.join(res['gone'])}" if res.get("gone") else ""
        err.print(escape(f"{output.get('type')} output ({res['source']}{gone})"), highlight=False)
    if isinstance(output.get("value"), str):
        typer.echo(output["value"])
    else:
        out.print(Syntax(json.dumps(output.get("value", res), ensure_ascii=False, indent=2), "json",
                         word_wrap=True))


@app.command()
def replay(ctx: typer.Context,
           file: Annotated[Path, typer.Argument(exists=True, readable=True, help="trajectory file")],
           episode: Annotated[int, typer.Option(min=0, help="which episode of a multi-episode file")] = 0,
           context_window: Annotated[int | None, typer.Option(min=1, help="context window in tokens")] = None,
           turns: Annotated[int | None, typer.Option("--turns", "-k", min=1,
                                                     help="replay only the first K turns")] = None,
           max_steps: Annotated[int | None, typer.Option(
               "--max-steps", min=1, help="model calls per turn (default: the length of the turn's script)")] = None,
           title: Annotated[str | None, typer.Option(help="conversation title")] = None,
           json_out: JsonFlag = False) -> None:
    """Replay a recorded trajectory through the running stack: a new conversation, one turn per user turn of
    the trajectory (replay provider), a progress bar over its model calls, then a summary per turn."""
    try:  # lazy: loading trajectories (and the provider SDKs) is only this command's cost
        from ctxbuild_providers.trajectories import load_trajectory
    except ImportError as exc:
        fail(f"this installation cannot read trajectories (ctxbuild_providers.trajectories: {escape(str(exc))})",
             EXIT_USAGE)
    try:
        traj = load_trajectory(file, episode=episode)
    except (ValueError, KeyError, TypeError, IndexError, OSError) as exc:
        message = str(exc) if str(file) in str(exc) else f"{file}: {type(exc).__name__}: {exc}"
        raise typer.BadParameter(message, param_hint="'FILE'") from exc
    chosen = traj.turns[:turns] if turns else traj.turns
    if not chosen:
        raise typer.BadParameter(f"{file}: episode {episode} has no turns to replay", param_hint="'FILE'")
    settings = {"contextWindow": context_window} if context_window else {}
    views: list[render.TurnView] = []
    with api(ctx) as client:
        cid = client.create_conversation(title or f"replay {traj.name}", settings)["id"]
        if not json_out:
            err.print(f"conversation {cid}: {escape(traj.name)} ({traj.format}), {len(chosen)} turn(s)",
                      highlight=False)
        planned = [len(t.script) for t in chosen]
        progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=err, disable=json_out)
        with progress:
            task = progress.add_task("replay", total=sum(planned))
            for i, (t, n) in enumerate(zip(chosen, planned, strict=True), 1):
                progress.update(task, description=f"turn {i}/{len(chosen)}")
                # a recorded run may take more model calls than the server's default allows a turn
                started = client.start_turn(cid, t.text, traj.replay_spec(i - 1), max_steps or n)
                view = render.TurnView(started["turnId"])
                for ev in client.events(cid, view.turn_id):
                    view.apply(ev)
                    if ev.type == "StepServed":
                        progress.advance(task)
                progress.update(task, completed=sum(planned[:i]))  # a failed turn skips the rest of its calls
                views.append(view)
        raw, note = raw_output_tokens(client, cid, views, [t.script for t in chosen])
    rows = [render.turn_summary(v, raw[v.turn_id]) for v in views]
    if json_out:
        emit_json({"conversationId": cid, "trajectory": {"name": traj.name, "format": traj.format,
                                                         "episode": episode, "file": str(file)},
                   "settings": settings, "turns": rows})
    else:
        out.print(render.render_replay_summary(rows, f"replay of {escape(traj.name)} in {cid}"))
        if note:
            err.print(note, highlight=False, markup=False)
    if any(v.status != "completed" for v in views):
        raise typer.Exit(EXIT_TURN_FAILED)


def raw_output_tokens(client: Client, cid: str, views: list[render.TurnView],
                      scripts: list[list[dict[str, Any]]]) -> tuple[dict[str, dict[str, int]], str | None]:
    """Per turn, toolCallId → tokens of the full output of each trimmed result: the recorded output when the
    script carries one, else the result read back from the blob store (GET …/results/{toolCallId})."""
    from ctxbuild_codec.tokens import count_output

    tokens: dict[str, dict[str, int]] = {v.turn_id: {} for v in views}
    missing: list[tuple[str, str]] = []
    for view, script in zip(views, scripts, strict=True):
        recorded = render.recorded_outputs(view, script)
        for row in view.served_steps:
            for c in row.calls:
                if c.trimmed and c.call_id in recorded:
                    tokens[view.turn_id][c.call_id] = count_output(recorded[c.call_id])
                elif c.trimmed:
                    missing.append((view.turn_id, c.call_id))
    if not missing:
        return tokens, None
    owner = {(m.get("turnId", ""), p.get("toolCallId", "")): m["id"]
             for m in client.messages(cid).get("messages", []) if m.get("role") == "tool" for p in m.get("parts", [])}
    unread = 0
    for turn_id, call in missing:
        mid = owner.get((turn_id, call))
        try:
            if mid is None:
                raise ApiError(404, "not-found", "no tool message (the turn did not complete)")
            tokens[turn_id][call] = render.full_output_tokens(client.result(cid, mid, call))
        except ApiError as exc:
            if exc.status not in (404, 405):
                raise
            unread += 1
    note = f"raw output tokens: {unread} trimmed output(s) could not be read back (n/a)" if unread else None
    return tokens, note


# ---------- API keys ----------
keys_app = typer.Typer(help="API keys of tenants (needs an admin credential: --admin-key / CTXBUILD_ADMIN_KEY, "
                            "the local stack's admin key, or an admin --api-key).", no_args_is_help=True)
app.add_typer(keys_app, name="keys")


@keys_app.command("create")
def keys_create(ctx: typer.Context,
                tenant: Annotated[str, typer.Option("--tenant", "-t", help="the tenant the key belongs to")],
                name: Annotated[str | None, typer.Option(help="a label for people")] = None,
                admin: Annotated[bool, typer.Option("--admin", help="the key may manage keys")] = False,
                rps: Annotated[int | None, typer.Option("--rps", min=1,
                                                        help="requests per second (default: the server's)")] = None,
                max_turns: Annotated[int | None, typer.Option(
                    "--max-turns", min=1, help="concurrent running turns (default: the server's)")] = None,
                json_out: JsonFlag = False) -> None:
    """Issue a key. It is shown once: the server keeps only its hash."""
    with api(ctx, admin=True) as client:
        key = client.create_key(tenant, name=name, admin=admin, requests_per_second=rps, max_running_turns=max_turns)
    if json_out:
        emit_json(key)
        return
    out.print(render.keys_table([key]))
    out.print(f"[bold]key[/bold] (shown once, store it now): {escape(key['key'])}", soft_wrap=True, highlight=False)


@keys_app.command("list")
def keys_list(ctx: typer.Context,
              tenant: Annotated[str | None, typer.Option("--tenant", "-t", help="only this tenant's keys")] = None,
              revoked: Annotated[bool, typer.Option("--revoked", help="include revoked keys")] = False,
              json_out: JsonFlag = False) -> None:
    """Issued keys (never their secrets)."""
    with api(ctx, admin=True) as client:
        keys = client.list_keys(tenant, revoked=revoked)
    if json_out:
        emit_json({"keys": keys})
        return
    out.print(render.keys_table(keys))


@keys_app.command("revoke")
def keys_revoke(ctx: typer.Context, key_id: Annotated[str, typer.Argument(help="the key's id (ctx_<keyId>_…)")],
                json_out: JsonFlag = False) -> None:
    """Revoke a key: refused at once by the replica asked, by every replica within CTX_AUTH_CACHE_S."""
    with api(ctx, admin=True) as client:
        done = client.revoke_key(key_id)
    if json_out:
        emit_json(done)
        return
    out.print(f"revoked key {escape(done['keyId'])}", highlight=False)
