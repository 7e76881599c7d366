"""LLM provider adapters: the interface, byte-stable rendering, and the offline replay provider."""

from .anthropic_messages import AnthropicMessagesProvider
from .base import ModelRequest, ModelResponse, Provider, ProviderError, ToolSpec
from .openai_chat import OpenAIChatProvider
from .replay import ReplayProvider, last_offload_uri

__all__ = ["AnthropicMessagesProvider", "ModelRequest", "ModelResponse", "OpenAIChatProvider", "Provider", "ProviderError", "ReplayProvider", "ToolSpec",
           "last_offload_uri"]
