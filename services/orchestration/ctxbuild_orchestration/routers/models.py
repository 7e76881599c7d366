"""The API's request bodies and its error shape (what the OpenAPI document describes)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_validator
from pydantic_core import PydanticCustomError

from ..app.edge import bad_text_at
from ..domain.keys import TENANT_PATTERN


class RequestBody(BaseModel):
    """A request body: every string in it (keys too) is text that can be stored, at any depth."""

    @model_validator(mode="before")
    @classmethod
    def _storable_text(cls, data: Any) -> Any:
        if (found := bad_text_at(data, "body")) is not None:
            raise PydanticCustomError("unstorable_text", "{problem}, which is not accepted", {"problem": found})
        return data


class ConversationSettings(BaseModel):
    contextWindow: int | None = Field(None, gt=0, description="model context window in tokens; null = unknown")
    reservation: int | None = Field(None, ge=0)
    truncateThreshold: int | None = Field(None, ge=2000)
    maxMessages: int | None = Field(None, ge=1)
    compressEnabled: bool = True
    mcpMode: Literal["manual", "auto", "disabled"] = "manual"
    mcpServers: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(default_factory=list,
                                                                                 max_length=100)
    webTools: bool = Field(True, description="offer the deployment's web tools (web_fetch, web_search) to the model")
    summarizer: Literal["extractive", "llm", "masking"] | None = Field(
        None, description="which summarizer folds (SPEC §10); null = the compaction service's default")


class CreateConversation(RequestBody):
    title: str | None = None
    settings: ConversationSettings = Field(default_factory=ConversationSettings)


class RecordedTool(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    description: str = ""
    inputSchema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class ReplaySpec(BaseModel):
    """Scripted or recorded model decisions (offline runs, demos, tests, trajectory replays). A step's
    toolCalls may carry a recorded `output`; `tools` are the recorded tools the turn offers."""

    kind: Literal["replay"]
    script: list[dict[str, Any]] = Field(min_length=1)
    tools: list[RecordedTool] = Field(default_factory=list)


class OpenAISpec(BaseModel):
    """A real model behind the server's configured OpenAI-compatible endpoint (CTX_OPENAI_BASE_URL/API_KEY)."""

    kind: Literal["openai"]
    model: str = Field(min_length=1, max_length=256)


class AnthropicSpec(BaseModel):
    """A Claude model through the Messages API (CTX_ANTHROPIC_API_KEY, optional CTX_ANTHROPIC_BASE_URL)."""

    kind: Literal["anthropic"]
    model: str = Field(min_length=1, max_length=256)


ProviderSpec = Annotated[ReplaySpec | OpenAISpec | AnthropicSpec, Field(discriminator="kind")]


class CreateTurn(RequestBody):
    text: str = Field(min_length=1)
    provider: ProviderSpec
    maxSteps: int | None = Field(None, ge=1, description="model calls this turn may make (default: the server's)")


class Regenerate(RequestBody):
    provider: ProviderSpec | None = Field(None, description="default: the regenerated turn's provider")
    maxSteps: int | None = Field(None, ge=1)


class Abort(RequestBody):
    reason: str | None = Field(None, max_length=500)


class CreateKey(RequestBody):
    tenantId: str = Field(min_length=1, max_length=128, pattern=TENANT_PATTERN)
    name: str | None = Field(None, max_length=200)
    admin: bool = Field(False, description="may manage keys (/v1/keys)")
    requestsPerSecond: int | None = Field(None, ge=1, le=100_000, description="default: the server's")
    maxRunningTurns: int | None = Field(None, ge=1, le=10_000, description="default: the server's")


class ApiError(BaseModel):
    """Every refusal of the API (typed service errors, request validation, the framework's own)."""

    code: str = Field(description="invalid-payload, not-found, too-large, turn-in-progress, …")
    message: str = Field(description="what was refused and why, for a person")
    retryable: bool
