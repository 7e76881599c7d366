"""Read a stored tool result back in full (SPEC §7 read-back, invariant 4): whatever way it was trimmed."""

from __future__ import annotations

import json
from typing import Any

from ctxbuild_codec.codecs import assemble
from ctxbuild_codec.records import offload_of


async def full_output(backends: Any, conversation_id: str, part: dict[str, Any]) -> dict[str, Any]:
    """``{output, source, gone?}``: ``persisted`` (an envelope inflated by the blob store), ``offloaded`` (the
    in-flight lane's blobs read back and reassembled) or ``stored`` (never trimmed). Access is the blob store's
    own check (the conversation must reference the blobs)."""
    output = part["output"]
    if output.get("type") == "persisted":
        r = await backends.rpc.call("ctx.blob.get_result", {"conversationId": conversation_id,
                                                           "envelope": output["value"]}, timeout=60)
        return {"output": r["output"], "source": "persisted", "gone": r.get("gone", [])}
    off = offload_of(part)  # a trimmed result's offload record, when its output went to the blob store
    if off is None:
        return {"output": output, "source": "stored"}
    if isinstance(off.get("original"), dict):
        # a non-text or json output kept whole (SPEC §15.1): read back byte-identical by the blob store
        r = await backends.blobs.get_result(conversation_id, offload=off)
        return {"output": r["output"], "source": "offloaded"}
    if off.get("sha256") and not off.get("blobs"):
        text = await backends.blobs.get_text(conversation_id, sha256=off["sha256"])
        kind = "error-text" if output.get("type") in ("error-text", "error-json") else "text"
        return {"output": {"type": kind, "value": text}, "source": "offloaded"}
    if off.get("blobs") and output.get("type") in ("json", "error-json"):
        texts = {b["key"]: await backends.blobs.get_text(conversation_id, sha256=b["sha256"]) for b in off["blobs"]}
        value = output["value"]
        parsed = json.loads(value) if isinstance(value, str) else value
        return {"output": {"type": output["type"], "value": assemble(parsed, texts)}, "source": "offloaded"}
    return {"output": output, "source": "stored"}
