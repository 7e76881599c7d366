"""Pure pieces of the CLI: folding a turn's events into a view, summaries, and the rich renderables for them.
Nothing here talks to the network; the commands in main.py feed it what the client returned."""

from __future__ import annotations

import hashlib
import json
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from .client import Event


# ---------- names and labels ----------
def short_tool_name(name: str) -> str:
    """`mcp__time__get_current_time_<hash>` → `mcp:time/get_current_time` (the replay scripts' notation)."""
    if name.startswith("mcp__"):
        server, _, rest = name[5:].partition("__")
        tool, sep, digest = rest.rpartition("_")
        return f"mcp:{server}/{tool if sep and digest.isalnum() else rest}"
    return name


def compaction_label(d: dict[str, Any]) -> str:
    """One CompactionDecided as a short label: `turn-start: skipped (under-trigger)`, `in-loop: folded 13,000→2,100`."""
    if d.get("status") == "done" and d.get("preTokens") is not None:
        label = f"folded {d['preTokens']:,}→{d.get('postTokens') or 0:,}"
    else:
        label = str(d.get("status")) + (f" ({d['reason']})" if d.get("reason") else "")
    if d.get("fallback"):
        label += f", {d['fallback']} fallback"
    return f"{d.get('phase', 'turn-start')}: {label}"


def clip(text: str, width: int = 80) -> str:
    one_line = " ".join(text.split())
    return one_line if len(one_line) <= width else one_line[: width - 1] + "…"


# ---------- a turn, folded from its events ----------
@dataclass
class ToolCallRow:
    call_id: str
    name: str
    recorded: bool = False
    trimmed: bool = False
    offloaded: bool = False
    output: dict[str, Any] | None = None
    offload: dict[str, Any] | None = None


@dataclass
class StepRow:
    step: int
    served_tokens: int | None = None
    messages: int | None = None
    usage: dict[str, int] = field(default_factory=dict)
    request_hash: str | None = None
    calls: list[ToolCallRow] = field(default_factory=list)
    compaction: list[str] = field(default_factory=list)
    folds: int = 0  # compactions that happened before this step (turn-start or in-loop)

    @property
    def trimmed(self) -> int:
        return sum(c.trimmed for c in self.calls)

    @property
    def offloaded(self) -> int:
        return sum(c.offloaded for c in self.calls)

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "servedTokens": self.served_tokens, "messagesServed": self.messages,
                "usage": self.usage, "requestHash": self.request_hash, "compaction": self.compaction,
                "toolCalls": [{"toolCallId": c.call_id, "toolName": c.name, "trimmed": c.trimmed,
                               "offloaded": c.offloaded, **({"uri": c.offload["uri"]}
                                                            if c.offload and c.offload.get("uri") else {})}
                              for c in self.calls]}


@dataclass
class TurnView:
    """What the live view shows: updated one event at a time by `apply` (events arrive in version order)."""

    turn_id: str
    status: str = "queued"
    steps: dict[int, StepRow] = field(default_factory=dict)
    failure: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)  # resumptions, abort requests
    message_ids: list[str] = field(default_factory=list)
    last_version: int = 0
    events: list[Event] = field(default_factory=list)

    def _row(self, step: int) -> StepRow:
        return self.steps.setdefault(step, StepRow(step))

    def _next_step(self) -> int:
        return max((s for s, r in self.steps.items() if r.served_tokens is not None), default=0) + 1

    def apply(self, event: Event) -> TurnView:
        d = event.data
        self.events.append(event)
        self.last_version = event.id
        kind = event.type
        if kind == "TurnQueued":
            self.status = "queued"
        elif kind == "TurnStarted":
            self.status = "running"
        elif kind == "TurnResumed":  # another replica picked the turn up (the first one died or drained)
            self.status = "running"
            self.notes.append(f"resumed (v{event.id})")
        elif kind == "TurnAbortRequested":
            self.notes.append("abort requested" + (f": {d['reason']}" if d.get("reason") else ""))
        elif kind == "CompactionDecided":
            # the turn-start decision precedes step 1; an in-loop one names the step it was made for
            step = d.get("step") or (1 if d.get("phase", "turn-start") == "turn-start" else self._next_step())
            row = self._row(step)
            row.compaction.append(compaction_label(d))
            row.folds += d.get("status") == "done"
        elif kind == "StepServed":
            row = self._row(d["step"])
            row.served_tokens, row.messages = d.get("servedTokens"), d.get("messagesServed")
            row.usage, row.request_hash = dict(d.get("usage") or {}), d.get("requestHash")
            self.status = "running"
        elif kind == "ToolCallRequested":
            self._row(d["step"]).calls.append(ToolCallRow(d["toolCallId"], d["toolName"]))
        elif kind == "ToolResultRecorded":
            row = self._row(d["step"])
            call = next((c for c in row.calls if c.call_id == d["toolCallId"]), None)
            if call is None:
                call = ToolCallRow(d["toolCallId"], d["toolName"])
                row.calls.append(call)
            offload = d.get("offload") or None
            call.recorded, call.trimmed = True, bool(d.get("trimmed"))
            call.output, call.offload = d.get("output"), offload
            call.offloaded = bool(offload and offload.get("mode") == "offloaded")
        elif kind == "TurnCompleted":
            self.status = "completed"
            self.message_ids = list(d.get("messageIds") or [])
        elif kind == "TurnFailed":
            self.status = "failed"
            self.failure = {"code": d.get("code"), "message": d.get("message")}
        return self

    @property
    def done(self) -> bool:
        return self.status in ("completed", "failed")

    @property
    def served_steps(self) -> list[StepRow]:
        return [self.steps[k] for k in sorted(self.steps) if self.steps[k].served_tokens is not None]

    def as_dict(self) -> dict[str, Any]:
        return {"turnId": self.turn_id, "status": self.status, "failure": self.failure, "notes": self.notes,
                "messageIds": self.message_ids, "steps": [self.steps[k].as_dict() for k in sorted(self.steps)]}


def fold(turn_id: str, events: list[Event]) -> TurnView:
    view = TurnView(turn_id)
    for e in events:
        view.apply(e)
    return view


def events_from_log(log: list[dict[str, Any]]) -> list[Event]:
    """Events as GET /turns/{tid} lists them (`{type, version, data}`) → the SSE shape."""
    return [Event(e["type"], int(e["version"]), e.get("data") or {}) for e in log]


STATUS_STYLE = {"queued": "dim", "running": "yellow", "completed": "green", "failed": "bold red"}


def usage_cell(usage: dict[str, int]) -> str:
    if not usage:
        return "—"
    cell = f"{usage.get('inputTokens', 0):,}/{usage.get('outputTokens', 0):,}"
    cache = [f"{label}{usage[key]:,}" for key, label in (("cacheReadTokens", "r"), ("cacheWriteTokens", "w"))
             if usage.get(key)]
    return cell + (f" (cache {' '.join(cache)})" if cache else "")


def tools_cell(calls: list[ToolCallRow]) -> Text:
    out = Text()
    for i, c in enumerate(calls):
        if i:
            out.append(", ")
        out.append(short_tool_name(c.name))
        if c.offloaded:
            out.append(" ✂→blob", style="cyan")
        elif c.trimmed:
            out.append(" ✂", style="cyan")
        elif not c.recorded:
            out.append(" …", style="dim")
    return out if calls else Text("—", style="dim")


def render_turn(view: TurnView, title: str | None = None, tail: int | None = None) -> Table:
    """The step table; `tail` keeps only the newest rows (a live view must fit its terminal, newest visible)."""
    table = Table(title=title or f"turn {view.turn_id}", title_justify="left", expand=False)
    for col, justify in (("step", "right"), ("served tokens", "right"), ("msgs", "right"),
                         ("usage in/out", "right"), ("tool calls", "left"), ("trimmed", "right"),
                         ("offloaded", "right"), ("compaction", "left"), ("request", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    keys = sorted(view.steps)
    if tail is not None and len(keys) > tail:
        table.add_row("…", Text(f"{len(keys) - tail} earlier step(s)", style="dim"))
        keys = keys[-tail:]
    for k in keys:
        r = view.steps[k]
        served = f"{r.served_tokens:,}" if r.served_tokens is not None else "…"
        table.add_row(str(r.step), served, str(r.messages) if r.messages is not None else "",
                      usage_cell(r.usage), tools_cell(r.calls), str(r.trimmed or ""), str(r.offloaded or ""),
                      Text("; ".join(r.compaction) or "—"), (r.request_hash or "")[:12])
    status = Text(view.status, style=STATUS_STYLE.get(view.status, ""))
    if view.notes:
        status.append(f" ({'; '.join(view.notes)})", style="dim")
    if view.failure:
        status.append(f" — {view.failure['code']}: {view.failure['message']}")
    elif view.done:
        status.append(f" — {len(view.served_steps)} model call(s)")
    table.caption = status
    table.caption_justify = "left"
    return table


def final_text(messages: list[dict[str, Any]], message_ids: list[str]) -> str:
    """The answer of a turn: the text of its last assistant message that has any."""
    ids = set(message_ids)
    for m in reversed(messages):
        if m.get("id") in ids and m.get("role") == "assistant":
            text = "".join(p.get("text", "") for p in m.get("parts", []) if p.get("type") == "text")
            if text:
                return text
    return ""


# ---------- history ----------
def history_rows(messages: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """(branch depth, message) in reading order: a message's first child continues its line, later children
    (regenerations, edits) open an indented branch. A chain of 500 messages stays flat. (The server answers
    with one path, siblings named in `branches`; a list holding several branches renders as a tree.)"""
    by_id = {m["id"]: m for m in messages}
    children: dict[str | None, list[dict[str, Any]]] = {}
    for m in messages:
        parent = m.get("parentId") if m.get("parentId") in by_id else None
        children.setdefault(parent, []).append(m)
    rows: list[tuple[int, dict[str, Any]]] = []
    stack = [(0, m) for m in reversed(children.get(None, []))]
    while stack:  # iterative DFS: deep chains must not hit the recursion limit
        depth, m = stack.pop()
        rows.append((depth, m))
        kids = children.get(m["id"], [])
        stack.extend((depth + (i > 0), k) for i, k in reversed(list(enumerate(kids))))
    return rows


def describe_part(part: dict[str, Any]) -> str:
    kind = part.get("type")
    if kind in ("text", "reasoning"):
        return ("(thinking) " if kind == "reasoning" else "") + clip(part.get("text", ""))
    if kind == "file":
        return f"[file {part.get('displayName') or part.get('handle')} {part.get('mediaType', '')}]"
    if kind == "tool-call":
        args = json.dumps(part.get("input"), ensure_ascii=False)
        return f"→ {short_tool_name(part.get('toolName', '?'))}({clip(args, 60)}) #{part.get('toolCallId')}"
    if kind == "tool-result":
        out = part.get("output") or {}
        value = out.get("value")
        size = f"{len(value):,} chars" if isinstance(value, str) else out.get("type", "?")
        note = ""
        off = part.get("offload")
        if off:
            note = f" [trimmed from {off.get('totalChars', 0):,} chars" + (
                f", full text {off['uri']}]" if off.get("uri") else "]")
        err = " error" if str(out.get("type", "")).startswith("error") else ""
        return f"← {short_tool_name(part.get('toolName', '?'))}{err}: {size}{note} #{part.get('toolCallId')}"
    return str(kind)


def render_history(history: dict[str, Any]) -> RenderableType:
    parts: list[RenderableType] = []
    atts = history.get("attachments") or []
    if atts:
        at = Table(title="attachments", title_justify="left")
        for col in ("handle", "media type", "size", "sha256"):
            at.add_column(col, justify="right" if col == "size" else "left")
        for a in atts:
            at.add_row(Text(a.get("handle", "")), Text(a.get("mediaType", "")), f"{a.get('size', 0):,}",
                       a.get("sha256", "")[:16])
        parts.append(at)
    table = Table(title=f"messages of {history.get('conversationId', '')}", title_justify="left")
    for col in ("message", "role", "turn", "content"):
        table.add_column(col, overflow="fold" if col == "content" else "ellipsis")
    siblings: dict[str, list[str]] = history.get("branches") or {}  # ?branches=true: path message → its siblings
    for depth, m in history_rows(history.get("messages") or []):
        content = "\n".join(describe_part(p) for p in m.get("parts", [])) or "—"
        if m["id"] in siblings:
            group = siblings[m["id"]]
            others = ", ".join(x for x in group if x != m["id"])
            content = f"[branch {group.index(m['id']) + 1}/{len(group)}; other: {others}]\n{content}"
        if m.get("compactionSummary"):
            content = f"[summary] {clip(m['compactionSummary'], 120)}\n{content}"
        branch = "  " * (depth - 1) + "└ " if depth else ""
        # Text, not str: message content is data, never rich markup ("[trimmed …]" must print as is)
        table.add_row(Text(branch + m["id"]), Text(m.get("role", "")), Text(m.get("turnId", "") or ""), Text(content))
    parts.append(table)
    return Group(*parts)


# ---------- the served request ----------
def render_request_bytes(doc: dict[str, Any]) -> bytes:
    """The bytes the server hashed (ctxbuild_providers.ModelRequest.render: insertion order model, system, tools,
    messages; compact; no ASCII escaping). Kept here so `ctxbuild request` does not import every provider SDK;
    a unit test pins it to ModelRequest.digest."""
    canon = {"model": doc.get("model"), "system": doc.get("system"), "tools": doc.get("tools", []),
             "messages": doc.get("messages", [])}
    return json.dumps(canon, ensure_ascii=False, separators=(",", ":")).encode()


def hash_match(raw: bytes, doc: dict[str, Any], expected: str | None) -> str | None:
    """How the served request matches StepServed.requestHash: "body" (the bytes as returned), "re-rendered"
    (the JSON re-rendered canonically), or None (no match / nothing to compare with)."""
    if not expected:
        return None
    if hashlib.sha256(raw).hexdigest() == expected:
        return "body"
    if hashlib.sha256(render_request_bytes(doc)).hexdigest() == expected:
        return "re-rendered"
    return None


def request_summary(doc: dict[str, Any]) -> dict[str, Any]:
    from ctxbuild_codec.tokens import count_message, count_text  # lazy: tiktoken only for this command

    messages = doc.get("messages") or []
    tools = doc.get("tools") or []
    rows = [{"index": i, "id": m.get("id"), "role": m.get("role"), "tokens": count_message(m),
             "parts": [describe_part(p) for p in m.get("parts", [])]} for i, m in enumerate(messages)]
    return {"model": doc.get("model"), "systemTokens": count_text(doc.get("system") or ""),
            "toolsTokens": count_text(json.dumps(tools, ensure_ascii=False)) if tools else 0,
            "tools": [t.get("name") for t in tools], "roles": dict(Counter(m.get("role") for m in messages)),
            "messageTokens": sum(r["tokens"] for r in rows), "messages": rows,
            "sha256": hashlib.sha256(render_request_bytes(doc)).hexdigest()}


def render_request(summary: dict[str, Any], step_served: dict[str, Any] | None, match: str | None) -> RenderableType:
    head = Table.grid(padding=(0, 2))
    head.add_row("model", Text(str(summary["model"])))
    head.add_row("system", f"{summary['systemTokens']:,} tokens")
    head.add_row("tools", Text(f"{len(summary['tools'])} ({summary['toolsTokens']:,} tokens): "
                               + (", ".join(short_tool_name(t) for t in summary["tools"]) or "none")))
    head.add_row("messages", f"{len(summary['messages'])} ({summary['messageTokens']:,} tokens) — "
                 + ", ".join(f"{role} {n}" for role, n in summary["roles"].items()))
    if step_served:
        head.add_row("served tokens", f"{step_served.get('servedTokens', 0):,} (StepServed)")
        expected = step_served.get("requestHash", "")
        verdict = (Text(f"matches StepServed ({match})", style="green") if match
                   else Text("DOES NOT match StepServed", style="bold red"))
        head.add_row("requestHash", Text(f"{expected} ").append(verdict))
    else:
        head.add_row("sha256", summary["sha256"])
    table = Table(title="messages served", title_justify="left")
    for col in ("#", "role", "tokens", "parts"):
        table.add_column(col, justify="right" if col in ("#", "tokens") else "left",
                         overflow="fold" if col == "parts" else "ellipsis")
    for r in summary["messages"]:
        table.add_row(str(r["index"]), Text(r["role"] or ""), f"{r['tokens']:,}", Text("\n".join(r["parts"]) or "—"))
    return Group(head, table)


# ---------- trajectory replay ----------
def turn_summary(view: TurnView, raw_output_tokens: dict[str, int] | None = None) -> dict[str, Any]:
    """One replayed turn for the summary table. `raw_output_tokens` maps toolCallId → tokens of that tool's
    full output (read back for trimmed ones); outputs that were not trimmed count as served. None = unknown."""
    from ctxbuild_codec.tokens import count_output  # lazy: tiktoken

    served = [r.served_tokens for r in view.served_steps if r.served_tokens is not None]
    calls = [c for r in view.served_steps for c in r.calls if c.recorded]
    served_out = sum(count_output(c.output or {}) for c in calls)
    raw: int | None = 0
    for c in calls:
        if not c.trimmed:
            raw = None if raw is None else raw + count_output(c.output or {})
        elif raw_output_tokens is not None and c.call_id in raw_output_tokens:
            raw = None if raw is None else raw + raw_output_tokens[c.call_id]
        else:
            raw = None
    return {"turnId": view.turn_id, "status": view.status, "steps": len(served),
            "servedMean": round(statistics.fmean(served)) if served else 0, "servedMax": max(served, default=0),
            "toolOutputs": len(calls), "servedOutputTokens": served_out, "rawOutputTokens": raw,
            "trimmed": sum(c.trimmed for c in calls), "offloaded": sum(c.offloaded for c in calls),
            "compactions": sum(r.folds for r in view.steps.values()), "failure": view.failure}


def render_replay_summary(rows: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("turn", "status", "steps", "served mean", "served max", "tool outputs raw→served",
                "trimmed", "offloaded", "compactions"):
        table.add_column(col, justify="left" if col == "status" else "right")
    for i, r in enumerate(rows, 1):
        status = Text(r["status"], style=STATUS_STYLE.get(r["status"], ""))
        if r.get("failure"):
            status.append(f" ({r['failure']['code']})")
        raw = f"{r['rawOutputTokens']:,}" if r["rawOutputTokens"] is not None else "n/a"
        table.add_row(str(i), status, str(r["steps"]), f"{r['servedMean']:,}", f"{r['servedMax']:,}",
                      f"{raw}→{r['servedOutputTokens']:,}", str(r["trimmed"]), str(r["offloaded"]),
                      str(r["compactions"]))
    if rows:
        served_max = max(r["servedMax"] for r in rows)
        raws = [r["rawOutputTokens"] for r in rows]
        raw_total = f"{sum(raws):,}" if all(x is not None for x in raws) else "n/a"
        table.add_section()
        table.add_row("all", f"{sum(r['status'] == 'completed' for r in rows)}/{len(rows)} completed",
                      str(sum(r["steps"] for r in rows)), "", f"{served_max:,}",
                      f"{raw_total}→{sum(r['servedOutputTokens'] for r in rows):,}",
                      str(sum(r["trimmed"] for r in rows)), str(sum(r["offloaded"] for r in rows)),
                      str(sum(r["compactions"] for r in rows)))
    return table


def recorded_outputs(view: TurnView, script: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """toolCallId → the output a replay script recorded for that call. Step k of a turn plays script[k-1]
    (the runner pins it), and its calls are requested in script order."""
    out: dict[str, dict[str, Any]] = {}
    for row in view.served_steps:
        if not 1 <= row.step <= len(script):
            continue
        recorded = script[row.step - 1].get("toolCalls") or []
        for call, entry in zip(row.calls, recorded, strict=False):
            if isinstance(entry.get("output"), dict):
                out[call.call_id] = entry["output"]
    return out


def full_output_tokens(result: dict[str, Any]) -> int:
    """Tokens of a full tool result as GET …/results/{toolCallId} returns it (an output, or a part holding one)."""
    from ctxbuild_codec.tokens import count_output, count_text

    if isinstance(result.get("output"), dict):
        return count_output(result["output"])
    if "type" in result and "value" in result:
        return count_output(result)
    if isinstance(result.get("text"), str):
        return count_text(result["text"])
    return count_text(json.dumps(result, ensure_ascii=False))



def keys_table(keys: list[dict[str, Any]]) -> Table:
    """API keys: id, tenant, name, scope, limits, created, revoked (never a secret)."""
    table = Table(title="API keys", show_lines=False)
    for col in ("key id", "tenant", "name", "scope", "limits", "created", "revoked"):
        table.add_column(col, overflow="fold", no_wrap=col in ("key id", "created", "revoked"))
    for k in keys:
        lim = k.get("limits") or {}
        limits = ", ".join(f"{v} {label}" for label, v in (("req/s", lim.get("requestsPerSecond")),
                                                          ("turns", lim.get("maxRunningTurns"))) if v) or "defaults"
        table.add_row(k["keyId"], k["tenantId"], k.get("name") or "", "admin" if k.get("admin") else "tenant",
                      limits, (k.get("createdAt") or "")[:19], (k.get("revokedAt") or "")[:19])
    return table
