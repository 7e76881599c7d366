"""The persist lane (SPEC §7) over one turn's messages, as pure logic around the codec library.

Every trimming decision is ``ctxbuild_codec``'s (``plan_persist`` / ``apply_persist``: the same policies, codecs
and trim primitive as the in-flight lane — there is one trim implementation, in libs/codec). This module only
walks the turn: which parts are candidates (``tool-result`` parts of ``tool`` messages), which blobs each
message must own, and what happened to each part.

    plans = plan_turn(messages, threshold)
    written = {(message_id, sha256): uri | None, ...}   # the blob store's answers, per owning message
    stored, report = apply_turn(messages, plans, written)

A blob whose write failed leaves its text in the part (a v1 output stays whole; a v2 keeps that entity's full
text) — "better fat than lost".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ctxbuild_codec import apply_persist, plan_persist
from ctxbuild_codec.lanes import TrimPlan, written_uri
from ctxbuild_codec.policy import effective_tool_name


@dataclass(frozen=True, slots=True)
class PartPlan:
    message_index: int
    part_index: int
    message_id: str
    plan: TrimPlan


@dataclass(frozen=True, slots=True)
class BlobWrite:
    """One ``ctx.blob.put``: a text, owned (``tool_output``) by the message whose part it came from."""

    message_id: str
    sha256: str
    text: str


def turn_stream(turn_id: str) -> str:
    """The stream a turn's own events live on (the only one ``turnAppend`` may name)."""
    return f"turn:{turn_id}"


def plan_turn(messages: Sequence[Mapping[str, Any]], threshold: int) -> list[PartPlan]:
    out: list[PartPlan] = []
    for i, m in enumerate(messages):
        if m.get("role") != "tool":
            continue
        for j, part in enumerate(m.get("parts") or []):
            plan = plan_persist(part, threshold)
            if plan is not None:
                out.append(PartPlan(i, j, m["id"], plan))
    return out


def blob_writes(plans: Sequence[PartPlan]) -> list[BlobWrite]:
    """Distinct (message, blob) pairs in order: the same text twice in one message is one write."""
    seen: dict[tuple[str, str], BlobWrite] = {}
    for p in plans:
        for cut in p.plan.blobs:
            seen.setdefault((p.message_id, cut.sha256), BlobWrite(p.message_id, cut.sha256, cut.text))
    return list(seen.values())


def _json_chars(value: Any) -> int:
    import json

    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def apply_turn(messages: Sequence[Mapping[str, Any]], plans: Sequence[PartPlan],
               written: Mapping[tuple[str, str], str | None]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The messages to store and one report row per candidate part (messages not touched are the same objects)."""
    out: list[Any] = list(messages)
    report: list[dict[str, Any]] = []
    by_message: dict[int, list[PartPlan]] = {}
    for p in plans:
        by_message.setdefault(p.message_index, []).append(p)
    for i, group in by_message.items():
        msg = dict(messages[i])
        parts = list(msg["parts"])
        mid = msg["id"]
        for p in group:
            part = parts[p.part_index]
            mine = {cut.sha256: written.get((mid, cut.sha256)) for cut in p.plan.cuts}
            new = apply_persist(part, p.plan, mine)
            parts[p.part_index] = new
            stored_refs = [cut for cut in p.plan.cuts if written_uri(cut, mine) is not None]
            persisted = new.get("output", {}).get("type") == "persisted"
            outcome = "kept" if not persisted else ("persisted" if len(stored_refs) == len(p.plan.cuts)
                                                     else "partial")
            report.append({
                "messageId": mid,
                "toolCallId": part.get("toolCallId", ""),
                "toolName": effective_tool_name(part),
                "outcome": outcome,
                "envelope": None if not persisted else ("v2" if p.plan.route == "codec" else "v1"),
                "blobs": [{"key": c.key, "sha256": c.sha256, "uri": c.uri} for c in stored_refs],
                "failedBlobs": len(p.plan.cuts) - len(stored_refs),
                "rawChars": sum(c.total_chars for c in p.plan.cuts),
                "outputChars": _json_chars(part.get("output")),
                "storedChars": _json_chars(new.get("output")),
            })
        msg["parts"] = parts
        out[i] = msg
    return out, report
