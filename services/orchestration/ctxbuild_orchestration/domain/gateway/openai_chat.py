"""OpenAI Chat Completions ↔ the neutral form: request parsing, the chat.completion body, the SSE chunk stream
and the error shape (SPEC §15.5). Pure: no I/O, no clock — ids and timestamps come from the caller."""

from __future__ import annotations

import json
from typing import Any

from .types import (
    ClientTool,
    DialectError,
    GatewayRequest,
    GatewayResult,
    effective_stop,
    invalid,
    sse_comment,
    tool_input_json,
    usage_counts,
)

_FINISH = {"stop": "stop", "tool_calls": "tool_calls", "length": "length"}
# the request fields parse_openai consumes; every other field is a sampling option passed on as sent
_CONSUMED = {"model", "messages", "tools", "tool_choice", "parallel_tool_calls", "stream", "stream_options",
             "max_tokens", "max_completion_tokens", "metadata", "n", "functions", "function_call"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
                404: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
                422: "invalid_request_error", 429: "rate_limit_error"}


def openai_error_type(status: int) -> str:
    """The `type` OpenAI's API gives an error of this status (5xx → server_error)."""
    return _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def openai_error(status: int, type: str, message: str, param: str | None = None,
                 code: str | None = None) -> dict:
    """OpenAI's error body; the status goes on the HTTP response, not in the body."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---------------------------------------------------------------------------------------------------- parse


def _text_of(content: Any, where: str, *, allow_refusal: bool = False) -> list[str]:
    """The texts of a message's ``content``: a string or an array of text parts; anything else is refused."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise invalid(f"{where}: content must be a string or an array of content parts", where)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and allow_refusal and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in ("image_url", "input_audio", "file"):
            raise invalid(f"{where}[{i}]: content part type '{kind}' is not supported by this gateway "
                          "(text only; attach files through ctxbuild's file API)", f"{where}[{i}]")
        else:
            raise invalid(f"{where}[{i}]: invalid content part", f"{where}[{i}]")
    return texts


def _text_parts(texts: list[str]) -> list[dict]:
    # empty strings carry nothing and some upstreams refuse empty text blocks
    return [{"type": "text", "text": t} for t in texts if t]


def _tool_calls(calls: Any, where: str, names: dict[str, str]) -> list[dict]:
    if not isinstance(calls, list):
        raise invalid(f"{where}: tool_calls must be an array", where)
    parts = []
    for i, call in enumerate(calls):
        at = f"{where}[{i}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(call.get("id"), str) or not isinstance(fn.get("name"), str):
            raise invalid(f"{at}: a tool call needs an id and function.name", at)
        raw = fn.get("arguments", "")
        if not isinstance(raw, str):
            raise invalid(f"{at}.function.arguments must be a string", f"{at}.function.arguments")
        # a model's arguments may be malformed JSON; OpenAI accepts them back as sent, so do we (kept verbatim
        # as a string, never refused: refusing would strand the client's whole conversation)
        try:
            args: Any = json.loads(raw) if raw.strip() else {}
        except ValueError:
            args = raw
        names[call["id"]] = fn["name"]
        parts.append({"type": "tool-call", "toolCallId": call["id"], "toolName": fn["name"], "input": args})
    return parts


def _messages(raw: Any) -> tuple[str | None, list[dict]]:
    if not isinstance(raw, list) or not raw:
        raise invalid("messages must be a non-empty array", "messages")
    system: list[str] = []
    out: list[dict] = []
    names: dict[str, str] = {}  # tool call id → tool name, for the tool messages that follow
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise invalid(f"{where} must be an object", where)
        role = msg.get("role")
        content = msg.get("content")
        if role in ("system", "developer"):
            system.extend(t for t in _text_of(content, f"{where}.content") if t)
        elif role == "user":
            if content is None:
                raise invalid(f"{where}.content is required", f"{where}.content")
            out.append({"role": "user", "parts": _text_parts(_text_of(content, f"{where}.content"))
                        or [{"type": "text", "text": ""}]})
        elif role == "assistant":
            parts = _text_parts(_text_of(content, f"{where}.content", allow_refusal=True))
            if msg.get("tool_calls"):
                parts += _tool_calls(msg["tool_calls"], f"{where}.tool_calls", names)
            if msg.get("function_call"):
                raise invalid(f"{where}.function_call (deprecated) is not supported: use tool_calls", where)
            if not parts and content is None:
                raise invalid(f"{where}: an assistant message needs content or tool_calls", f"{where}.content")
            out.append({"role": "assistant", "parts": parts or [{"type": "text", "text": ""}]})
        elif role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str):
                raise invalid(f"{where}.tool_call_id is required", f"{where}.tool_call_id")
            if call_id not in names:
                raise invalid(f"{where}: tool_call_id '{call_id}' does not answer a tool call of an earlier "
                              "assistant message", f"{where}.tool_call_id")
            value = "".join(_text_of(content, f"{where}.content"))
            out.append({"role": "tool", "parts": [{"type": "tool-result", "toolCallId": call_id,
                                                   "toolName": names[call_id],
                                                   "output": {"type": "text", "value": value}}]})
        elif role == "function":
            raise invalid(f"{where}: role 'function' (deprecated) is not supported: use role 'tool'", where)
        else:
            raise invalid(f"{where}.role: invalid role {role!r}", f"{where}.role")
    if not out:
        raise invalid("messages must hold at least one user, assistant or tool message", "messages")
    return ("\n\n".join(system) or None), out


def _tools(raw: Any) -> list[ClientTool]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise invalid("tools must be an array", "tools")
    tools, seen = [], set()
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise invalid(f"{where}: only function tools are supported", where)
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"{where}.function.name is required", f"{where}.function.name")
        if name in seen:
            raise invalid(f"{where}: duplicate tool name '{name}'", f"{where}.function.name")
        seen.add(name)
        schema = fn.get("parameters")
        if schema is None:
            schema = {"type": "object", "properties": {}}
        if not isinstance(schema, dict):
            raise invalid(f"{where}.function.parameters must be an object", f"{where}.function.parameters")
        tools.append(ClientTool(name=name, description=str(fn.get("description") or ""), input_schema=schema))
    return tools


def _tool_choice(raw: Any, tools: list[ClientTool]) -> dict | None:
    if raw is None:
        return None
    if raw in ("auto", "none", "required"):
        choice = {"type": raw}
    elif isinstance(raw, dict) and raw.get("type") == "function" \
            and isinstance((raw.get("function") or {}).get("name"), str):
        choice = {"type": "tool", "name": raw["function"]["name"]}
        if choice["name"] not in {t.name for t in tools}:
            raise invalid(f"tool_choice names '{choice['name']}', which is not among tools", "tool_choice")
    else:
        raise invalid("tool_choice must be 'auto', 'none', 'required' or "
                      "{'type': 'function', 'function': {'name': …}}", "tool_choice")
    if choice["type"] != "none" and not tools:
        raise invalid("tool_choice is only allowed when tools are specified", "tool_choice")
    return choice


def _positive_int(body: dict, key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid(f"{key} must be a positive integer", key)
    return value


def parse_openai(body: Any) -> GatewayRequest:
    """A Chat Completions request body → the neutral request; refusals as OpenAI words them (400)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("you must provide a model parameter", "model")
    system, messages = _messages(body.get("messages"))
    tools = _tools(body.get("tools"))
    if body.get("functions") is not None:
        raise invalid("functions (deprecated) is not supported: use tools", "functions")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise invalid("stream must be a boolean", "stream")
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not stream:
            raise invalid("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                          "stream_options")
        if not isinstance(stream_options, dict):
            raise invalid("stream_options must be an object", "stream_options")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if body.get("n") not in (None, 1):
        raise invalid("n must be 1: this gateway returns one choice", "n")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise invalid("metadata must be an object", "metadata")
    conversation = (metadata or {}).get("conversation_id")
    if conversation is not None and not isinstance(conversation, str):
        raise invalid("metadata.conversation_id must be a string", "metadata.conversation_id")
    max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
    return GatewayRequest(
        dialect="openai", model=model, system=system, messages=messages, tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools), parallel_tool_calls=parallel, stream=stream,
        include_usage=bool((stream_options or {}).get("include_usage")), max_tokens=max_tokens,
        conversation_id=conversation or None,
        options={k: v for k, v in body.items() if k not in _CONSUMED})


# --------------------------------------------------------------------------------------------------- encode


def _usage(usage: dict) -> dict:
    prompt, output, read, _ = usage_counts(usage)
    # prompt_tokens is the whole prompt, cached tokens included (OpenAI's own meaning, and the runtime's)
    return {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output,
            "prompt_tokens_details": {"cached_tokens": read}}


def _wire_calls(result: GatewayResult) -> list[dict]:
    return [{"id": c["toolCallId"], "type": "function",
             "function": {"name": c["toolName"], "arguments": tool_input_json(c.get("input", {}))}}
            for c in result.tool_calls]


def openai_completion(result: GatewayResult, *, id: str, model: str, created: int) -> dict:
    """The chat.completion object for a finished turn."""
    message: dict[str, Any] = {"role": "assistant",
                               "content": result.text if result.text or not result.tool_calls else None,
                               "refusal": None}
    if result.tool_calls:
        message["tool_calls"] = _wire_calls(result)
    return {"id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": _FINISH[effective_stop(result)]}],
            "usage": _usage(result.usage)}


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False,
                                                                separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class OpenAIStream:
    """chat.completion.chunk SSE: a role chunk, text deltas, then the client's tool calls, the finish reason,
    the usage chunk (with stream_options.include_usage) and ``data: [DONE]``. Text sent with text() is not
    sent again by finish(); text finish() has beyond it (a turn that produced no deltas) is sent there."""

    def __init__(self, *, id: str, model: str, created: int, include_usage: bool) -> None:
        self.id, self.model, self.created, self.include_usage = id, model, created, include_usage
        self._started = False
        self._sent = ""
        self._done = False

    def _chunk(self, delta: dict, finish: str | None = None) -> bytes:
        chunk: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                                 "model": self.model,
                                 "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                              "finish_reason": finish}]}
        if self.include_usage:
            chunk["usage"] = None  # as OpenAI does: every chunk but the last carries usage: null
        return _sse(chunk)

    def start(self) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        return [self._chunk({"role": "assistant", "content": ""})]

    def text(self, delta: str) -> list[bytes]:
        if not delta or self._done:
            return []
        self._sent += delta
        return [*self.start(), self._chunk({"content": delta})]

    def finish(self, result: GatewayResult) -> list[bytes]:
        if self._done:
            return []
        out = self.start()
        if result.text.startswith(self._sent) and len(result.text) > len(self._sent):
            out += self.text(result.text[len(self._sent):])
        self._done = True
        for i, call in enumerate(_wire_calls(result)):
            out.append(self._chunk({"tool_calls": [{"index": i, **call}]}))
        out.append(self._chunk({}, _FINISH[effective_stop(result)]))
        if self.include_usage:
            out.append(_sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                             "model": self.model, "choices": [], "usage": _usage(result.usage)}))
        out.append(_sse("[DONE]"))
        return out

    def ping(self) -> list[bytes]:
        """Keep-alive while a server-side tool loop runs: Chat Completions has no ping event, an SSE comment."""
        return [] if self._done else [sse_comment("ping")]

    def error(self, status: int, type: str, message: str) -> list[bytes]:
        """A failure after the response started: OpenAI's in-stream error event (the SDKs raise on it)."""
        if self._done:
            return []
        self._done = True
        return [_sse(openai_error(status, type, message))]


__all__ = ["DialectError", "OpenAIStream", "openai_completion", "openai_error", "openai_error_type",
           "parse_openai"]
