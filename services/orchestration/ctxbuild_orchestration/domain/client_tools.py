"""The gateway's client tools in a turn (SPEC §15.5), pure: a turn command may carry the client's own tools
(TurnQueued.clientTools). They are offered upstream beside ctxbuild's own (a name clash: the client's wins and
ctxbuild's is not offered); a step that calls any of them ends the turn with those calls pending — the client
runs them and sends the results on its next request — while the step's other (server-side) calls run here."""

from __future__ import annotations

from typing import Any

from ctxbuild_providers import ToolSpec

from .gateway import GatewayResult
from .turn_state import TurnState, message_id

PREFIX_STREAM = "gwprefix:"  # gwprefix:<hash>: the gateway's implicit conversation identity (app/gateway.py)


def input_record(turn_id: str) -> str:
    """The persist-lane record id of a gateway turn's input with client tool results (its messages' ``turnId``):
    not the turn's own, so compaction never takes them for the turn's rows."""
    return f"{turn_id}.input"
STEP_SEPARATOR = "\n\n"  # between the texts of two steps, streamed and not


def client_specs(command: dict[str, Any]) -> list[ToolSpec]:
    return [ToolSpec(t["name"], t.get("description") or "", t.get("inputSchema") or {"type": "object"})
            for t in command.get("clientTools") or []]


def client_names(command: dict[str, Any]) -> frozenset[str]:
    return frozenset(t["name"] for t in command.get("clientTools") or [])


def with_client_tools(ours: list[ToolSpec], client: list[ToolSpec]) -> list[ToolSpec]:
    """ctxbuild's tools first (without those the client names itself), then the client's in its order."""
    names = {t.name for t in client}
    return [t for t in ours if t.name not in names] + list(client)


def is_client_call(part: dict[str, Any], clients: frozenset[str]) -> bool:
    return part.get("type") == "tool-call" and part.get("toolName") in clients


def client_calls(assistant: dict[str, Any], clients: frozenset[str]) -> list[dict[str, Any]]:
    """The calls of an assistant message that the client runs (in the model's order)."""
    return [p for p in assistant.get("parts") or [] if is_client_call(p, clients)]


def server_view(assistant: dict[str, Any], clients: frozenset[str]) -> dict[str, Any]:
    """The assistant message as far as the server runs it: the client's calls left out."""
    return {**assistant, "parts": [p for p in assistant.get("parts") or [] if not is_client_call(p, clients)]}


def handed_over_messages(st: TurnState, user_message_id: str, step: int,
                         clients: frozenset[str]) -> list[dict[str, Any]]:
    """The turn's messages when ``step`` hands calls to the client: every earlier step whole, the step's assistant
    message with all its calls, then a tool message with the results of its server-side calls (if it had any) —
    the client's results arrive as the next tool message, so no call is left without a result."""
    out = st.messages(user_message_id)
    rec = st.steps[step]
    server = [c for c in rec.calls if c["toolName"] not in clients]
    parts = [rec.results[c["toolCallId"]] for c in server if c["toolCallId"] in rec.results]
    if parts:
        out.append({"id": message_id(st.turn_id, step, "t"), "parentId": rec.assistant["id"], "role": "tool",
                    "parts": parts, "turnId": st.turn_id})
    return out


def gateway_result(st: TurnState, pending: frozenset[str] | set[str]) -> GatewayResult:
    """What the client sees of a completed turn: the steps' text (one paragraph per step that said something),
    the client's calls of the last step (``pending``), usage summed over the steps."""
    texts: list[str] = []
    usage: dict[str, int] = {}
    for k in sorted(st.steps):
        a = st.steps[k].assistant
        text = "".join(p.get("text", "") for p in a["parts"] if p.get("type") == "text")
        if text:
            texts.append(text)
        for key, value in (a.get("usage") or {}).items():
            if isinstance(value, int):
                usage[key] = usage.get(key, 0) + value
    calls = []
    if pending and st.steps:
        last = st.steps[max(st.steps)].assistant
        calls = [{"toolCallId": p["toolCallId"], "toolName": p["toolName"], "input": p.get("input") or {}}
                 for p in last["parts"] if p.get("type") == "tool-call" and p["toolCallId"] in pending]
    usage.setdefault("inputTokens", 0)
    usage.setdefault("outputTokens", 0)
    return GatewayResult(text=STEP_SEPARATOR.join(texts), tool_calls=calls,
                         stop_reason="tool_calls" if calls else "stop", usage=usage)


def result_summary(st: TurnState, result: GatewayResult) -> dict[str, Any]:
    """A completed gateway turn's response as its end notice carries it (TurnEndedNotice.result)."""
    return {"text": result.text, "toolCalls": result.tool_calls, "stopReason": result.stop_reason,
            "usage": result.usage, "servedTokens": sum(r.served_tokens for r in st.steps.values()),
            "modelMs": round(sum(r.model_ms for r in st.steps.values()), 3)}
