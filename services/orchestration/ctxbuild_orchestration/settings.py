from __future__ import annotations

from ctxbuild_platform.settings import ServiceSettings
from pydantic import Field, SecretStr


class Settings(ServiceSettings):
    service_name: str = "orchestration"
    max_steps: int = Field(20, description="a turn that needs more model calls ends with TurnFailed(step-limit)")
    default_model: str = "replay"
    sse_poll_s: float = Field(0.2, description="SSE: how often to read new turn events when no wake-up arrives")
    tool_timeout_s: float = 60.0
    openai_base_url: str | None = Field(
        None, description="OpenAI-compatible endpoint (vLLM, Ollama, Gemini, …); unset = api.openai.com")
    openai_api_key: SecretStr | None = Field(None, description="never defaulted; local servers accept any")
    anthropic_base_url: str | None = Field(None, description="unset = api.anthropic.com")
    anthropic_api_key: SecretStr | None = Field(None, description="never defaulted")
