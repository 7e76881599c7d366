"""Anthropic Messages ↔ the neutral form: request parsing, the message body, the SSE event stream and the
error shape (SPEC §15.5). Pure: no I/O, no clock — ids come from the caller."""

from __future__ import annotations

import json
from typing import Any

from .types import (
    ClientTool,
    GatewayRequest,
    GatewayResult,
    effective_stop,
    invalid,
    tool_input_json,
    usage_counts,
)

_STOP = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}
_CONSUMED = {"model", "messages", "system", "tools", "tool_choice", "stream", "max_tokens", "metadata"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                422: "invalid_request_error", 429: "rate_limit_error", 529: "overloaded_error"}
# blocks a client may send back that carry nothing the runtime can serve again: thinking without its
# signature is refused upstream, so it is dropped rather than kept half
_DROPPED = {"thinking", "redacted_thinking"}


def anthropic_error_type(status: int) -> str:
    """The `type` Anthropic's API gives an error of this status (other 5xx → api_error)."""
    return _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error(status: int, type: str, message: str) -> dict:
    """Anthropic's error body; the status goes on the HTTP response."""
    return {"type": "error", "error": {"type": type, "message": message}}


# ---------------------------------------------------------------------------------------------------- parse


def _texts(content: Any, where: str) -> list[str]:
    """A string or an array of text blocks (system, tool_result content)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise invalid(f"{where}: expected a string or an array of content blocks")
    out = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            out.append(block["text"])
        elif kind in ("image", "document", "search_result"):
            raise invalid(f"{where}.{i}: content block type '{kind}' is not supported by this gateway "
                          "(text only; attach files through ctxbuild's file API)")
        else:
            raise invalid(f"{where}.{i}: invalid content block")
    return out


def _media_block(block: dict, at: str) -> dict:
    """An image/document block of a tool result → the MCP-style block a ``content`` output holds (the
    in-flight lane keeps it whole in the original blob and shows the model a marker)."""
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str):
        return {"type": block["type"], "data": source["data"], "mimeType": str(source.get("media_type") or "")}
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return {"type": "resource_link", "uri": source["url"], "name": block["type"]}
    raise invalid(f"{at}: unsupported {block['type']} source (base64 or url only)")


def _tool_output(content: Any, is_error: bool, where: str) -> dict:
    """A tool_result's content → a text output (the blocks' texts joined), or, with images or documents among
    them, a ``content`` output that keeps every block."""
    if not isinstance(content, list) or all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return {"type": "error-text" if is_error else "text", "value": "".join(_texts(content, where))}
    blocks = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            blocks.append({"type": "text", "text": block["text"]})
        elif kind in ("image", "document"):
            blocks.append(_media_block(block, f"{where}.{i}"))
        else:
            raise invalid(f"{where}.{i}: content block type '{kind}' is not supported in a tool_result")
    # Anthropic's is_error has no place in a content output but its metadata
    return {"type": "content", "value": blocks, **({"metadata": {"isError": True}} if is_error else {})}


def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}: expected a string or an array of content blocks")
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise invalid(f"{where}.{i}: invalid content block")
    return content


def _user(content: Any, where: str, names: dict[str, str]) -> list[dict]:
    """One user message → its tool results (each its own neutral tool message, first) then its text."""
    results, texts = [], []
    for i, block in enumerate(_blocks(content, where)):
        at = f"{where}.{i}"
        kind = block["type"]
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise invalid(f"{at}.text: field required")
            texts.append(block["text"])
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise invalid(f"{at}.tool_use_id: field required")
            if call_id not in names:
                raise invalid(f"{at}: unexpected `tool_use_id` found in `tool_result` blocks: {call_id}. Each "
                              "`tool_result` block must have a corresponding `tool_use` block in an earlier "
                              "message.")
            output = _tool_output(block.get("content"), bool(block.get("is_error")), f"{at}.content")
            results.append({"role": "tool", "parts": [{"type": "tool-result", "toolCallId": call_id,
                                                       "toolName": names[call_id], "output": output}]})
        elif kind in ("image", "document", "search_result"):
            raise invalid(f"{at}: content block type '{kind}' is not supported by this gateway "
                          "(text only; attach files through ctxbuild's file API)")
        else:
            raise invalid(f"{at}: content block type '{kind}' is not allowed in a user message")
    text_parts = [{"type": "text", "text": t} for t in texts if t]
    if results:
        return results + ([{"role": "user", "parts": text_parts}] if text_parts else [])
    return [{"role": "user", "parts": text_parts or [{"type": "text", "text": ""}]}]


def _assistant(content: Any, where: str, names: dict[str, str]) -> dict:
    parts: list[dict] = []
    for i, block in enumerate(_blocks(content, where)):
        at = f"{where}.{i}"
        kind = block["type"]
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise invalid(f"{at}.text: field required")
            if block["text"]:
                parts.append({"type": "text", "text": block["text"]})
        elif kind == "tool_use":
            call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise invalid(f"{at}: a tool_use block needs an id and a name")
            if not isinstance(args, dict):
                raise invalid(f"{at}.input: Input should be a valid dictionary")
            names[call_id] = name
            parts.append({"type": "tool-call", "toolCallId": call_id, "toolName": name, "input": args})
        elif kind in _DROPPED:
            continue
        else:
            raise invalid(f"{at}: content block type '{kind}' is not supported in an assistant message "
                          "by this gateway")
    return {"role": "assistant", "parts": parts or [{"type": "text", "text": ""}]}


def _messages(raw: Any) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise invalid("messages: at least one message is required")
    out: list[dict] = []
    names: dict[str, str] = {}  # tool_use id → tool name, for the tool_result blocks that follow
    for i, msg in enumerate(raw):
        where = f"messages.{i}"
        if not isinstance(msg, dict) or "content" not in msg:
            raise invalid(f"{where}: a message needs a role and content")
        role = msg.get("role")
        if role == "user":
            out += _user(msg["content"], f"{where}.content", names)
        elif role == "assistant":
            out.append(_assistant(msg["content"], f"{where}.content", names))
        else:
            raise invalid(f"{where}.role: Input should be 'user' or 'assistant'")
    return out


def _tools(raw: Any) -> list[ClientTool]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise invalid("tools: Input should be a valid list")
    tools, seen = [], set()
    for i, tool in enumerate(raw):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise invalid(f"{where}: Input should be an object")
        if tool.get("type") not in (None, "custom"):
            raise invalid(f"{where}: server tool '{tool.get('type')}' is not supported by this gateway "
                          "(client tools with input_schema only)")
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise invalid(f"{where}.name: Field required")
        if not isinstance(schema, dict):
            raise invalid(f"{where}.input_schema: Field required")
        if name in seen:
            raise invalid(f"tools: Tool names must be unique ('{name}')")
        seen.add(name)
        tools.append(ClientTool(name=name, description=str(tool.get("description") or ""), input_schema=schema))
    return tools


def _tool_choice(raw: Any, tools: list[ClientTool]) -> tuple[dict | None, bool | None]:
    if raw is None:
        return None, None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind in ("auto", "none"):
        choice = {"type": kind}
    elif kind == "any":
        choice = {"type": "required"}
    elif kind == "tool" and isinstance(raw.get("name"), str):
        choice = {"type": "tool", "name": raw["name"]}
        if raw["name"] not in {t.name for t in tools}:
            raise invalid(f"tool_choice: tool '{raw['name']}' not found in tools")
    else:
        raise invalid("tool_choice: expected {'type': 'auto'|'any'|'none'} or {'type': 'tool', 'name': …}")
    if kind != "none" and not tools:
        raise invalid("tool_choice may only be specified while providing tools.")
    disable = raw.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise invalid("tool_choice.disable_parallel_tool_use: Input should be a valid boolean")
    return choice, (None if disable is None else not disable)


def parse_anthropic(body: Any) -> GatewayRequest:
    """A Messages request body → the neutral request; refusals as Anthropic words them (400)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model: Field required")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise invalid("max_tokens: Field required (a positive integer)")
    system = "\n\n".join(t for t in _texts(body.get("system"), "system") if t) or None
    messages = _messages(body.get("messages"))
    tools = _tools(body.get("tools"))
    choice, parallel = _tool_choice(body.get("tool_choice"), tools)
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise invalid("stream: Input should be a valid boolean")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise invalid("metadata: Input should be an object")
    conversation = (metadata or {}).get("conversation_id")
    if conversation is not None and not isinstance(conversation, str):
        raise invalid("metadata.conversation_id: Input should be a valid string")
    return GatewayRequest(
        dialect="anthropic", model=model, system=system, messages=messages, tools=tools, tool_choice=choice,
        parallel_tool_calls=parallel, stream=stream, include_usage=True, max_tokens=max_tokens,
        conversation_id=conversation or None,
        options={k: v for k, v in body.items() if k not in _CONSUMED})


# --------------------------------------------------------------------------------------------------- encode


def _usage(usage: dict) -> dict:
    prompt, output, read, write = usage_counts(usage)
    # Anthropic's input_tokens is only the prompt's uncached tail; the runtime's inputTokens is the whole
    return {"input_tokens": max(prompt - read - write, 0), "output_tokens": output,
            "cache_read_input_tokens": read, "cache_creation_input_tokens": write}


def _tool_uses(result: GatewayResult) -> list[dict]:
    out = []
    for c in result.tool_calls:
        args = c.get("input", {})
        if not isinstance(args, dict):  # an OpenAI client's malformed arguments, kept verbatim on parse
            args = {}
        out.append({"type": "tool_use", "id": c["toolCallId"], "name": c["toolName"], "input": args})
    return out


def anthropic_message(result: GatewayResult, *, id: str, model: str) -> dict:
    """The message object for a finished turn."""
    content = ([{"type": "text", "text": result.text}] if result.text else []) + _tool_uses(result)
    return {"id": id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": _STOP[effective_stop(result)], "stop_sequence": None, "usage": _usage(result.usage)}


def _event(name: str, payload: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


class AnthropicStream:
    """The Messages event stream: message_start and a ping, one text block fed by text(), then one tool_use
    block per client call (its input as a single input_json_delta), message_delta with the stop reason and the
    turn's usage, message_stop. Text sent with text() is not sent again by finish(); text finish() has beyond
    it (a turn that produced no deltas) is sent there."""

    def __init__(self, *, id: str, model: str) -> None:
        self.id, self.model = id, model
        self._started = False
        self._sent = ""
        self._index = 0  # the next content block's index
        self._open_text = False
        self._done = False

    def start(self) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   # the prompt's size is known only once the turn is served: message_delta carries it
                   "usage": {"input_tokens": 0, "output_tokens": 0}}
        return [_event("message_start", {"type": "message_start", "message": message}),
                _event("ping", {"type": "ping"})]

    def text(self, delta: str) -> list[bytes]:
        if not delta or self._done:
            return []
        out = self.start()
        if not self._open_text:
            self._open_text = True
            out.append(_event("content_block_start", {"type": "content_block_start", "index": self._index,
                                                      "content_block": {"type": "text", "text": ""}}))
        self._sent += delta
        out.append(_event("content_block_delta", {"type": "content_block_delta", "index": self._index,
                                                  "delta": {"type": "text_delta", "text": delta}}))
        return out

    def _close_text(self) -> list[bytes]:
        if not self._open_text:
            return []
        self._open_text = False
        self._index += 1
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self._index - 1})]

    def finish(self, result: GatewayResult) -> list[bytes]:
        if self._done:
            return []
        out = self.start()
        if result.text.startswith(self._sent) and len(result.text) > len(self._sent):
            out += self.text(result.text[len(self._sent):])
        out += self._close_text()
        self._done = True
        for use in _tool_uses(result):
            i = self._index
            self._index += 1
            out += [_event("content_block_start", {"type": "content_block_start", "index": i,
                                                   "content_block": {**use, "input": {}}}),
                    _event("content_block_delta", {"type": "content_block_delta", "index": i,
                                                   "delta": {"type": "input_json_delta",
                                                             "partial_json": tool_input_json(use["input"])}}),
                    _event("content_block_stop", {"type": "content_block_stop", "index": i})]
        out += [_event("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": _STOP[effective_stop(result)],
                                                   "stop_sequence": None},
                                         "usage": _usage(result.usage)}),
                _event("message_stop", {"type": "message_stop"})]
        return out

    def ping(self) -> list[bytes]:
        """Keep-alive while a server-side tool loop runs (Anthropic's own ping event)."""
        return [] if self._done else [*self.start(), _event("ping", {"type": "ping"})]

    def error(self, status: int, type: str, message: str) -> list[bytes]:
        """A failure after the response started: Anthropic's `error` event (the SDKs raise on it)."""
        if self._done:
            return []
        self._done = True
        return [_event("error", anthropic_error(status, type, message))]


__all__ = ["AnthropicStream", "anthropic_error", "anthropic_error_type", "anthropic_message",
           "parse_anthropic"]
