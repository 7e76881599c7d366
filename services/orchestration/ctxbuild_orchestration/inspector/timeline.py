"""What the inspector shows, derived from the records (pure: unit-tested without servers).

- :func:`conversation_view`: a conversation stream's events → its settings, attachments, messages as a tree
  (siblings = branches), compaction summaries with their transcript links, archived outputs.
- :func:`turn_timeline`: a turn's events (+ the conversation's messages before it, + the served requests) → one
  row per step: served tokens (StepServed.servedTokens), the raw history (every message of the path up to the
  step, each output at its full length, nothing folded — the bench's definition, same cl100k counter; a trimmed
  output's full tokens are estimated from its full length), cache-read tokens when the provider reported them,
  the window and the compaction trigger, and markers: outputs trimmed / blobs offloaded (on the step whose request
  first carries them), compaction (turn-start, in-loop, in-process fit) and a broken prefix (request k-1 is not a
  prefix of request k: system, tools and every earlier message byte-equal — expected where compaction ran).
- :func:`request_diff`: request k against request k-1: how many messages are the kept prefix, which are new.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from ctxbuild_codec import compaction_budget
from ctxbuild_codec.envelopes import EnvelopeError, render
from ctxbuild_codec.records import archived_blobs, offload_of
from ctxbuild_codec.tokens import MESSAGE_OVERHEAD, count_output, count_part

VFS_URI = re.compile(r"context://vfs/vfs_[0-9a-f]{16}\.txt")
TERMINAL = ("TurnCompleted", "TurnFailed")


def canonical(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=False)


def trace_id_of(metadata: Mapping[str, Any] | None) -> str | None:
    """The trace id of a W3C ``traceparent`` (``00-<32 hex>-<16 hex>-<2 hex>``) in an event's metadata."""
    tp = (metadata or {}).get("traceparent")
    if not isinstance(tp, str):
        return None
    parts = tp.split("-")
    if len(parts) == 4 and re.fullmatch(r"[0-9a-f]{32}", parts[1]) and parts[1] != "0" * 32:
        return parts[1]
    return None


def uris_in(text: str) -> list[str]:
    return list(dict.fromkeys(VFS_URI.findall(text or "")))


# ---------------------------------------------------------------- conversation

def conversation_view(events: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """A conversation stream folded for display: header, attachments, messages (by id, with children), roots,
    summaries (boundary → summary text + transcript URIs) and every archived output (URI → tool call)."""
    out: dict[str, Any] = {"title": None, "tenantId": None, "settings": {}, "createdAt": None, "attachments": [],
                           "messages": {}, "order": [], "children": {}, "roots": [], "summaries": {},
                           "archives": []}
    seen_archive: set[str] = set()

    def add(message: Mapping[str, Any], at: str | None) -> None:
        mid = message.get("id")
        if not isinstance(mid, str) or mid in out["messages"]:
            return
        out["messages"][mid] = {**message, "recordedAt": at}
        out["order"].append(mid)
        parent = message.get("parentId")
        if parent:
            out["children"].setdefault(parent, []).append(mid)
        else:
            out["roots"].append(mid)
        for part in message.get("parts") or []:
            for blob in archived_blobs(part):
                if blob.uri not in seen_archive:
                    seen_archive.add(blob.uri)
                    out["archives"].append({"uri": blob.uri, "kind": "tool output", "messageId": mid,
                                            "toolCallId": blob.tool_call_id, "toolName": part.get("toolName"),
                                            "turnId": message.get("turnId")})

    for e in events:
        d, t = e.get("data") or {}, e.get("type")
        if t == "ConversationCreated":
            out.update(title=d.get("title"), tenantId=d.get("tenantId", "default"), settings=d.get("settings") or {},
                       createdAt=e.get("recordedAt"))
        elif t == "UserMessageAdded":
            add(d.get("message") or {}, e.get("recordedAt"))
        elif t == "AssistantMessageCompleted":
            for m in d.get("messages") or []:
                add(m, e.get("recordedAt"))
        elif t == "AttachmentAdded":
            out["attachments"].append(d.get("attachment") or {})
        elif t == "CompactionSummaryRecorded":
            summary = d.get("summary") or ""
            transcripts = uris_in(summary.rsplit("\n", 1)[-1]) if "transcript" in summary.rsplit("\n", 1)[-1] \
                else []
            out["summaries"][d.get("boundaryId")] = {"summary": summary, "transcripts": transcripts,
                                                     "turnId": d.get("turnId"), "summarizer": d.get("summarizer"),
                                                     "foldedCount": d.get("foldedCount")}
            for uri in transcripts:
                if uri not in seen_archive:
                    seen_archive.add(uri)
                    out["archives"].append({"uri": uri, "kind": "compaction transcript",
                                            "messageId": d.get("boundaryId"), "turnId": d.get("turnId")})
    return out


def path_to(view: Mapping[str, Any], message_id: str | None) -> list[dict[str, Any]]:
    """The messages root → ``message_id`` (inclusive) of a :func:`conversation_view`."""
    msgs = view["messages"]
    path: list[dict[str, Any]] = []
    seen: set[str] = set()
    while message_id and message_id in msgs and message_id not in seen:
        seen.add(message_id)
        path.append(msgs[message_id])
        message_id = msgs[message_id].get("parentId")
    return path[::-1]


def tree_rows(view: Mapping[str, Any], current_path: set[str]) -> list[dict[str, Any]]:
    """The message tree depth-first, one row per message with its depth (a new depth only where there are
    branches), whether it is on the current path, and its siblings' count."""
    rows: list[dict[str, Any]] = []
    msgs, children = view["messages"], view["children"]

    def walk(mid: str, depth: int, siblings: int, nth: int) -> None:
        stack = [(mid, depth, siblings, nth)]
        while stack:
            m, d, s, i = stack.pop()
            rows.append({"message": msgs[m], "depth": d, "siblings": s, "nth": i, "current": m in current_path})
            kids = [k for k in children.get(m, []) if k in msgs]
            nd = d + 1 if len(kids) > 1 else d
            for j, k in reversed(list(enumerate(kids, 1))):
                stack.append((k, nd, len(kids), j))

    roots = [r for r in view["roots"] if r in msgs]
    for n, r in enumerate(roots, 1):
        walk(r, 0 if len(roots) == 1 else 1, len(roots), n)
    return rows


def preview(message: Mapping[str, Any], limit: int = 140) -> str:
    bits: list[str] = []
    for p in message.get("parts") or []:
        kind = p.get("type")
        if kind == "text":
            bits.append(p.get("text") or "")
        elif kind == "tool-call":
            bits.append(f"→ {p.get('toolName')}({canonical(p.get('input'))[:80]})")
        elif kind == "tool-result":
            off = offload_of(p)
            bits.append(f"← {p.get('toolName')}" + (" [trimmed, archived]" if off else ""))
        elif "ref" in p or kind == "content-ref":
            bits.append("[stored by reference]")
        else:
            bits.append(f"[{kind}]")
    text = " ".join(b.replace("\n", " ") for b in bits)
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---------------------------------------------------------------- raw history tokens

def _served_text(output: Mapping[str, Any]) -> str:
    value = output.get("value")
    if output.get("type") == "persisted" and isinstance(value, Mapping):
        try:
            return _served_text(render(value))
        except EnvelopeError:
            return canonical(value)
    if isinstance(value, str):
        return value
    return canonical(value)


def full_part_tokens(part: Mapping[str, Any]) -> int:
    """A part's tokens as it was before any trim: a trimmed output's full tokens are estimated from its full
    length (``totalChars`` of its offload or envelope) at the served text's tokens per character."""
    served = count_part(dict(part))
    if part.get("type") != "tool-result":
        return served
    output = part.get("output") or {}
    total = (offload_of(part) or {}).get("totalChars")
    if total is None and output.get("type") == "persisted" and isinstance(output.get("value"), Mapping):
        total = output["value"].get("totalChars")
    if not isinstance(total, int):
        return served
    text_len = len(_served_text(output))
    if text_len <= 0:
        return served
    return max(served, round(total * count_output(output) / text_len))


def full_message_tokens(message: Mapping[str, Any]) -> int:
    return MESSAGE_OVERHEAD + sum(full_part_tokens(p) for p in message.get("parts") or [])


# ---------------------------------------------------------------- requests

def prefix_kept(prev: Mapping[str, Any] | None, cur: Mapping[str, Any]) -> dict[str, Any]:
    """How request ``cur`` relates to the previous step's request: system/tools equal, how many leading messages
    are byte-equal (``kept``), whether every earlier message is kept (``extends``)."""
    if prev is None:
        return {"first": True, "kept": 0, "extends": True, "systemSame": True, "toolsSame": True,
                "previousMessages": 0, "messages": len(cur.get("messages") or [])}
    pm, cm = prev.get("messages") or [], cur.get("messages") or []
    kept = 0
    for a, b in zip(pm, cm, strict=False):
        if canonical(a) != canonical(b):
            break
        kept += 1
    system_same = canonical(prev.get("system")) == canonical(cur.get("system"))
    tools_same = canonical(prev.get("tools")) == canonical(cur.get("tools"))
    return {"first": False, "kept": kept, "extends": system_same and tools_same and kept == len(pm),
            "systemSame": system_same, "toolsSame": tools_same, "previousMessages": len(pm), "messages": len(cm)}


def request_diff(prev: Mapping[str, Any] | None, cur: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One entry per message of ``cur``: ``kept`` (byte-equal to the same position of the previous request,
    the cached prefix) or ``new`` (the tail this step added or rewrote)."""
    rel = prefix_kept(prev, cur)
    return [{"index": i, "message": m, "state": "kept" if i < rel["kept"] else "new"}
            for i, m in enumerate(cur.get("messages") or [])]


# ---------------------------------------------------------------- turn timeline

def _marker(kind: str, label: str, **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "label": label, **{k: v for k, v in extra.items() if v is not None}}


def turn_timeline(events: list[Mapping[str, Any]], settings: Mapping[str, Any],
                  before: list[Mapping[str, Any]], requests: Mapping[int, Mapping[str, Any] | None]
                  ) -> dict[str, Any]:
    """One row per served step of a turn. ``before``: the path's messages up to and including the turn's user
    message (the raw history the turn starts from); ``requests``: step → the served request as JSON (None when
    it was not kept: then no prefix check for it)."""
    window = settings.get("contextWindow")
    budget = compaction_budget(window, settings.get("reservation")) if window else None
    raw = sum(full_message_tokens(m) for m in before)
    steps: dict[int, dict[str, Any]] = {}
    order: list[int] = []
    pending: list[dict[str, Any]] = []  # compaction markers waiting for the step they apply to
    carried: dict[int, list[dict[str, Any]]] = {}  # markers of results recorded at step k → shown on step k+1
    added_after: dict[int, int] = {}  # raw tokens a step's answer and results add to the history
    status = "queued"
    terminal: dict[str, Any] | None = None
    fold_uris: list[str] | None = None
    for e in events:
        t, d = e.get("type"), e.get("data") or {}
        if t in ("TurnStarted", "TurnResumed"):
            status = "running"
        elif t == "CompactionDecided":
            phase, st = d.get("phase", "turn-start"), d.get("status")
            if st == "done" and d.get("preTokens") is not None:
                label = f"{phase} compaction: {d['preTokens']:,} → {d.get('postTokens') or 0:,} tokens"
                if d.get("summarizer"):
                    label += f" ({d['summarizer']})"
                pending.append(_marker("compaction-" + phase, label, boundaryId=d.get("boundaryId"),
                                       phase=phase, pre=d.get("preTokens"), post=d.get("postTokens"),
                                       uris=fold_uris if phase == "in-loop" else None))
                fold_uris = None
            elif d.get("fallback"):
                pending.append(_marker("fit", f"{phase}: window fitted in-process ({d['fallback']})",
                                       phase=phase, reason=d.get("reason")))
        elif t == "InLoopFoldRecorded":  # the checkpoint comes just before its CompactionDecided
            fold_uris = list(d.get("persistedUris") or [])
        elif t == "StepServed":
            k = d["step"]
            usage = d.get("usage") or {}
            row = {"step": k, "servedTokens": d.get("servedTokens"), "messagesServed": d.get("messagesServed"),
                   "inputTokens": usage.get("inputTokens"), "outputTokens": usage.get("outputTokens"),
                   "cacheReadTokens": usage.get("cacheReadTokens"),
                   "cacheWriteTokens": usage.get("cacheWriteTokens"), "requestHash": d.get("requestHash"),
                   "requestBytes": d.get("requestBytes"), "modelMs": d.get("modelMs"),
                   "stopReason": d.get("stopReason"), "requestKept": bool(d.get("request")),
                   "traceId": trace_id_of(e.get("metadata")), "recordedAt": e.get("recordedAt"),
                   "markers": pending + carried.pop(k, []), "tools": [], "rawTokens": 0}
            pending = []
            steps[k] = row
            order.append(k)
            answer = d.get("assistantMessage")
            if isinstance(answer, Mapping):
                added_after[k] = added_after.get(k, 0) + full_message_tokens(answer)
        elif t == "ToolCallRequested":
            if d.get("step") in steps:
                steps[d["step"]]["tools"].append(d.get("toolName"))
        elif t == "ToolResultRecorded":
            k = d.get("step")
            part = {"type": "tool-result", "toolCallId": d.get("toolCallId"), "toolName": d.get("toolName"),
                    "output": d.get("output") if isinstance(d.get("output"), Mapping) else {}}
            if d.get("offload"):
                part["offload"] = d["offload"]
            added_after[k] = added_after.get(k, 0) + full_part_tokens(part)
            if d.get("trimmed"):
                off = d.get("offload") or {}
                uri = off.get("uri") if off.get("mode") == "offloaded" else None
                total = off.get("totalChars")
                label = f"{d.get('toolName')} output trimmed" + (f" ({total:,} chars)" if total else "")
                carried.setdefault(k + 1, []).append(_marker(
                    "trimmed", label, toolCallId=d.get("toolCallId"), uri=uri, fromStep=k))
                if uri:
                    carried[k + 1].append(_marker("offloaded", "full text archived in the blob store", uri=uri,
                                                  toolCallId=d.get("toolCallId"), fromStep=k))
        elif t in TERMINAL:
            status = "completed" if t == "TurnCompleted" else "failed"
            terminal = {"type": t, **{x: d.get(x) for x in ("code", "message", "steps", "answer") if x in d}}
    # results recorded at the last step have no next request: shown where they were recorded
    for k, ms in carried.items():
        if k - 1 in steps:
            steps[k - 1]["markers"] += ms
    # the raw history at step k: the path before the turn + every answer and result of steps < k, untrimmed
    running = raw
    prev_req: Mapping[str, Any] | None = None
    for k in sorted(order):
        row = steps[k]
        row["rawTokens"] = running
        running += added_after.get(k, 0)
        req = requests.get(k)
        if req is not None:
            rel = prefix_kept(prev_req, req)
            row["prefix"] = rel
            compacted = any(m["kind"].startswith("compaction") or m["kind"] == "fit" for m in row["markers"])
            if not rel["extends"]:
                why = "expected: compaction rewrote the history" if compacted else "unexpected"
                row["markers"].append(_marker("prefix-broke", f"prefix broke at message {rel['kept']} ({why})",
                                              expected=compacted, kept=rel["kept"]))
            prev_req = req
        else:
            row["prefix"] = None
            prev_req = None
    rows = [steps[k] for k in sorted(order)]
    return {"status": status, "terminal": terminal, "window": window,
            "trigger": budget.trigger if budget else None, "inputRoom": budget.input_room if budget else None,
            "steps": rows, "cacheReported": any(r["cacheReadTokens"] is not None for r in rows)}
