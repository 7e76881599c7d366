"""The gateway's pure translation layer (SPEC §15.5): OpenAI Chat Completions and Anthropic Messages requests
→ one neutral request, a turn's result → each dialect's body or SSE stream, each dialect's error shape, and the
prefix hash chain that gives a resent conversation its identity."""

from .anthropic_messages import (
    AnthropicStream,
    anthropic_error,
    anthropic_error_type,
    anthropic_message,
    parse_anthropic,
)
from .identity import canonical_message, chain_hash, prefix_hashes, root_hash
from .openai_chat import OpenAIStream, openai_completion, openai_error, openai_error_type, parse_openai
from .types import ClientTool, DialectError, GatewayRequest, GatewayResult, result_message, sse_comment

__all__ = [
    "AnthropicStream",
    "ClientTool",
    "DialectError",
    "GatewayRequest",
    "GatewayResult",
    "OpenAIStream",
    "anthropic_error",
    "anthropic_error_type",
    "anthropic_message",
    "canonical_message",
    "chain_hash",
    "openai_completion",
    "openai_error",
    "openai_error_type",
    "parse_anthropic",
    "parse_openai",
    "prefix_hashes",
    "result_message",
    "root_hash",
    "sse_comment",
]
