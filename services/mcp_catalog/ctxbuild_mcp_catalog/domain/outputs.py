"""Map an MCP ``tools/call`` result to a ToolOutput (contracts/model/tool-output.json)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

MAX_ERROR_CHARS = 20_000


def content_output(blocks: Sequence[Mapping[str, Any]], structured: Any = None) -> dict[str, Any]:
    """A successful call: the MCP content blocks as they came (text, image, audio, resource, resource_link —
    every field kept, for the codec). Structured content rides along intact in ``metadata.structuredContent``;
    a result that only has structured content also gets one text block with its compact JSON (the MCP spec
    asks servers to send both; some don't)."""
    value = [dict(b) for b in blocks]
    if not value and structured is not None:
        value = [{"type": "text", "text": json.dumps(structured, ensure_ascii=False, separators=(",", ":"))}]
    out: dict[str, Any] = {"type": "content", "value": value}
    if structured is not None:
        out["metadata"] = {"structuredContent": structured}
    return out


def error_text(message: str) -> dict[str, Any]:
    return {"type": "error-text", "value": message[:MAX_ERROR_CHARS]}


def cancelled() -> dict[str, Any]:
    """The output of a call cancelled by ``ctx.mcp.cancel``."""
    return error_text("the call was cancelled")


def error_from_blocks(blocks: Sequence[Mapping[str, Any]], structured: Any = None) -> dict[str, Any]:
    """A call the tool itself reported as failed (``isError``): its text blocks joined; else the blocks as
    JSON; else a generic message."""
    texts = [b["text"] for b in blocks if b.get("type") == "text" and isinstance(b.get("text"), str)]
    if texts:
        return error_text("\n".join(texts))
    if blocks:
        return error_text(json.dumps(list(blocks), ensure_ascii=False, separators=(",", ":")))
    if structured is not None:
        return error_text(json.dumps(structured, ensure_ascii=False, separators=(",", ":")))
    return error_text("the tool reported an error without details")


def call_output(blocks: Sequence[Mapping[str, Any]], is_error: bool, structured: Any = None) -> dict[str, Any]:
    return error_from_blocks(blocks, structured) if is_error else content_output(blocks, structured)
