"""LLM provider adapters: the interface, byte-stable rendering, the streaming SDK adapters, the offline replay
provider, and loaders that turn recorded agent runs into replay turns."""

from .anthropic_messages import AnthropicMessagesProvider, anthropic_client
from .base import ModelRequest, ModelResponse, Provider, ProviderError, TextCallback, ToolSpec
from .openai_chat import OpenAIChatProvider, openai_client
from .replay import ReplayProvider, last_offload_uri
from .trajectories import ReplayTurn, Trajectory, TrajectoryError, episode_count, load_trajectory

__all__ = ["AnthropicMessagesProvider", "ModelRequest", "ModelResponse", "OpenAIChatProvider", "Provider",
           "ProviderError", "ReplayProvider", "ReplayTurn", "TextCallback", "ToolSpec", "Trajectory",
           "TrajectoryError", "anthropic_client", "episode_count", "last_offload_uri", "load_trajectory",
           "openai_client"]
