"""Pure pieces of the step loop: building messages and summarising a turn's events for reports."""

from __future__ import annotations

from typing import Any

from ctxbuild_codec.records import offload_of


def assistant_message(msg_id: str, parent_id: str | None, turn_id: str, parts: list[dict[str, Any]],
                      usage: dict[str, int] | None) -> dict[str, Any]:
    m: dict[str, Any] = {"id": msg_id, "parentId": parent_id, "role": "assistant", "parts": parts, "turnId": turn_id}
    if usage:
        m["usage"] = usage
    return m


def tool_message(msg_id: str, parent_id: str, turn_id: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": msg_id, "parentId": parent_id, "role": "tool", "parts": results, "turnId": turn_id}


def tool_result(call: dict[str, Any], output: dict[str, Any], effective: str | None = None) -> dict[str, Any]:
    part = {"type": "tool-result", "toolCallId": call["toolCallId"], "toolName": call["toolName"], "output": output}
    if effective and effective != call["toolName"]:
        part["effectiveToolName"] = effective
    return part


def compaction_label(decision: dict[str, Any]) -> str:
    """A CompactionDecided in a few words: ``folded 12,000→3,000``, or its status and reason."""
    if decision.get("status") == "done" and decision.get("preTokens") is not None:
        return f"folded {decision['preTokens']:,}→{decision.get('postTokens') or 0:,}"
    return decision["status"] + (f": {decision['reason']}" if decision.get("reason") else "")


def step_rows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per model call from a turn's events: what was served, which outputs were trimmed."""
    rows: dict[int, dict[str, Any]] = {}
    compaction = None
    for e in events:
        d = e["data"]
        if e["type"] == "CompactionDecided":
            compaction = compaction_label(d)
        elif e["type"] == "StepServed":
            rows[d["step"]] = {"step": d["step"], "servedTokens": d["servedTokens"],
                               "inputTokens": (d.get("usage") or {}).get("inputTokens"),
                               "messages": d["messagesServed"], "tools": [], "trimmed": 0, "offloaded": 0,
                               "compaction": compaction or "-", "requestHash": d["requestHash"][:12]}
            compaction = None
        elif e["type"] == "ToolCallRequested" and d["step"] in rows:
            rows[d["step"]]["tools"].append(d["toolName"])
        elif e["type"] == "ToolResultRecorded" and d["step"] in rows and d.get("trimmed"):
            rows[d["step"]]["trimmed"] += 1
            rows[d["step"]]["offloaded"] += int(offload_of(d) is not None)
    return [rows[k] for k in sorted(rows)]

