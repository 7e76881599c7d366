from __future__ import annotations

from typing import Any, Literal

from ctxbuild_platform.settings import ServiceSettings
from pydantic import BaseModel, Field, SecretStr, model_validator

from .domain.web.settings import WebToolSettings


def retried(default: float, what: str, until: str) -> Any:
    """A runner patience in seconds: how long ``what`` is retried (with backoff) ``until``."""
    sep = "" if until.startswith(";") else " "
    return Field(default, ge=0, description=f"runner: how long {what} is retried{sep}{until}")


def one_call(default: float, what: str, then: str) -> Any:
    """A runner timeout in seconds (> 0): how long one ``what`` may take, and ``then`` what happens past it."""
    return Field(default, gt=0, description=f"runner: one {what}; {then}")


class GatewayModel(BaseModel):
    """One model of the gateway's model table (SPEC §15.5): where it runs and how large its window is."""

    dialect: Literal["openai", "anthropic"] = Field(description="the upstream's wire format (CTX_OPENAI_* or "
                                                    "CTX_ANTHROPIC_* endpoint)")
    contextWindow: int = Field(ge=1024, description="tokens: compaction at turn start and in the loop keeps every "
                               "served request within it")
    upstreamModel: str | None = Field(None, description="the model name sent upstream (default: the table key)")
    summarizer: str | None = Field(None, description="extractive | masking | llm (default: CTX_GATEWAY_SUMMARIZER)")
    ownedBy: str = "ctxbuild"


# a few well-known models; CTX_GATEWAY_MODELS replaces the table
DEFAULT_GATEWAY_MODELS = {
    "gpt-4o": {"dialect": "openai", "contextWindow": 128_000},
    "gpt-4o-mini": {"dialect": "openai", "contextWindow": 128_000},
    "gpt-4.1": {"dialect": "openai", "contextWindow": 1_047_576},
    "claude-sonnet-4-5": {"dialect": "anthropic", "contextWindow": 200_000},
    "claude-haiku-4-5": {"dialect": "anthropic", "contextWindow": 200_000},
}


class Settings(ServiceSettings, WebToolSettings):
    service_name: str = "orchestration"
    role: Literal["all", "edge", "runner"] = Field(
        "all", description="edge = HTTP API only; runner = pulls turns from the work queue only; all = both")
    max_steps: int = Field(20, ge=1, description="default model calls per turn; more ends it with "
                           "TurnFailed(step-limit)")
    max_steps_limit: int = Field(200, ge=1, description="the most a turn may ask for with maxSteps")
    max_concurrent_turns: int = Field(16, ge=1, description="turns one runner replica runs at once")
    turn_ack_wait_s: float = Field(30.0, gt=1, description="a runner silent this long (no heartbeat) loses its turn "
                                   "to another replica, which resumes it from the events")
    turns_stream: str = Field("CTX_TURNS", description="JetStream work-queue stream of turn commands")
    turns_subject: str = Field("ctx.turn.run", description="subject of the turn commands (the stream's only one)")
    turns_stream_replicas: int = Field(1, ge=1, le=5, description="replicas of the turns stream when a replica "
                                       "creates it (3 on a three-node JetStream cluster)")
    turns_consumer: str = Field("turn-runner", description="durable pull consumer shared by the runner replicas")
    turn_max_deliveries: int = Field(10, ge=2, description="a turn command delivered more often is parked on the "
                                     "dead-letter stream instead of being run again")
    dead_letter_stream: str = Field("CTX_DEAD_LETTERS", description="JetStream stream of parked messages "
                                    "(subjects ctx.dlq.<original subject>)")
    persist_patience_s: float = retried(120.0, "a persistence call (append by event id, read, persist lane)",
                                        "while persistence/Postgres is away")
    terminal_patience_s: float = retried(600.0, "a turn's terminal event",
                                         "; then the command is handed back (resumed or ended later)")
    model_whole_answer_timeout_s: float = one_call(
        600.0, "model call that is not streamed (a gateway client that asked for one whole answer: nothing arrives "
        "before the whole answer is written; a streamed call's timeout is between chunks)",
        "past it the call fails as a timeout (the SDK retries it)")
    lazy_turn_start_s: float = Field(
        2.0, ge=0, description="runner: a first attempt whose first model call is not streamed (a gateway client's "
        "non-streamed request: nothing is shown while it runs) writes TurnStarted only when the call outlasts this, or "
        "when anything else must be written or run first (a tool call, a fold); answered sooner with nothing to run, "
        "TurnStarted rides at the head of the turn's closing commit (one commit fewer, the same expected version). 0: "
        "always written beside the call")
    compaction_timeout_s: float = one_call(120.0, "compaction call (an llm summarizer is a model call)",
                                           "past it the runner fits the window in-process")
    compaction_heartbeat_s: float = Field(2.0, gt=0, description="runner: compaction calls ask for progress this "
                                          "often; 3 missed (the replica died with the call, or the call still waits "
                                          "for a free handler slot on a busy replica) and the runner fits the window "
                                          "in-process")
    turn_start_local_plan: bool = Field(True, description="runner: a turn start with nothing to fold is planned "
                                        "here from the history (the compaction service's code, shared in "
                                        "ctxbuild_codec.turn_start) without a ctx.compact.turn_start call; a fold "
                                        "is always the compaction service's. false: every turn start asks "
                                        "compaction")
    truncate_attempt_timeout_s: float = one_call(15.0, "ctx.truncate.step attempt (+1 s per 4 MiB of outputs)",
                                                 "a timed-out attempt is sent again")
    truncate_attempts: int = Field(3, ge=1, description="runner: attempts of ctx.truncate.step (idempotent)")
    blob_patience_s: float = retried(30.0, "an idempotent blob-store call (a turn's large content, reads)",
                                     "while the blob store or S3 is away")
    keep_request_patience_s: float = retried(20.0, "a served request's blob write",
                                             "before StepServed records it missing")
    keep_served_requests: bool = Field(True, description="store each step's request bytes (GET …/steps/{n}/request)")
    default_model: str = "replay"
    sse_poll_s: float = Field(2.0, gt=0, description="SSE: the backstop read of a turn's new events when no "
                              "wake-up (ctx.turn.appended/ended) arrived — a lost notice costs at most this")
    abort_grace_s: float = Field(10.0, ge=0, description="edge: an aborted running turn no runner ended within "
                                 "this long is ended by the edge (one terminal event id either way)")
    admission_grace_s: float = Field(60.0, gt=0, description="edge: a turn admitted this long ago with no event yet "
                                     "frees its conversation; one whose only event is its command is submitted "
                                     "to the work queue again (the edge that recorded it may have died before "
                                     "submitting it)")
    tool_timeout_s: float = 60.0
    trace_ui_url: str | None = Field(None, description="inspector (/ui): a trace UI URL with {trace_id}, e.g. "
                                     "http://localhost:16686/trace/{trace_id} (Jaeger); unset = trace ids as text")
    openai_base_url: str | None = Field(
        None, description="OpenAI-compatible endpoint (vLLM, Ollama, Gemini, …); unset = api.openai.com")
    openai_api_key: SecretStr | None = Field(None, description="never defaulted; local servers accept any")
    anthropic_base_url: str | None = Field(None, description="unset = api.anthropic.com")
    anthropic_api_key: SecretStr | None = Field(None, description="never defaulted")

    # the drop-in gateway (SPEC §15.5): /v1/chat/completions, /v1/messages, /v1/models
    gateway_models: dict[str, GatewayModel] = Field(
        default_factory=lambda: {k: GatewayModel(**v) for k, v in DEFAULT_GATEWAY_MODELS.items()},
        description="the model table as JSON: model → {dialect, contextWindow, upstreamModel?, summarizer?}")
    gateway_passthrough: bool = Field(True, description="a model missing from the table is served on the "
                                      "upstream of the request's own dialect with CTX_GATEWAY_DEFAULT_CONTEXT_WINDOW "
                                      "(false: 404 model_not_found)")
    gateway_default_context_window: int = Field(128_000, ge=1024, description="the window of a passthrough model")
    gateway_summarizer: str | None = Field(None, description="the summarizer of gateway conversations "
                                           "(extractive | masking | llm; unset: the compaction service's default)")
    gateway_web_tools: bool = Field(False, description="offer web_fetch/web_search upstream on gateway requests")
    gateway_mcp_mode: Literal["manual", "auto", "disabled"] = Field(
        "manual", description="MCP tools on gateway requests: auto = every registered MCP server's tools (through "
        "the meta-tools when deferred), run server-side; manual/disabled = none")
    gateway_max_steps: int = Field(20, ge=1, description="model calls one gateway request may take server-side")
    gateway_wait_s: float = Field(600.0, gt=0, description="the longest a gateway request waits for its turn")

    # edge input limits (SPEC §15.3): over them → 413 with the limit named, never a 5xx or an unreadable event
    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="a JSON request body, counted while read")
    max_attachment_bytes: int = Field(
        4 * 1024 * 1024 * 1024, ge=1024,
        description="an attachment upload (its multipart body, streamed to the blob store)")
    max_title_chars: int = Field(1000, ge=1, description="a conversation title")
    max_turn_text_bytes: int = Field(
        8 * 1024 * 1024, ge=1, description="a turn's user text (UTF-8); a large one is stored by content reference")
    max_replay_script_bytes: int = Field(
        48 * 1024 * 1024, ge=1, description="a replay provider's script + tools as JSON (over 32 KiB: a blob)")
    max_attachment_name_chars: int = Field(255, ge=1, description="an attachment's file name")

    # authentication and tenants (SPEC §15.3, adapters/auth.py): every /v1 call carries an API key or an OIDC token
    admin_api_key: SecretStr | None = Field(
        None, description="bootstrap admin credential (manages /v1/keys); never defaulted — unset: no admin key")
    auth_cache_s: float = Field(5.0, ge=0, le=60, description="a verified API key is trusted this long without "
                                "re-hashing; also the most a revocation takes to reach every replica")
    key_requests_per_second: int = Field(50, ge=1, description="default requests per second per credential "
                                         "(per edge replica); a key may carry its own")
    key_max_running_turns: int = Field(4, ge=1, description="default concurrent running turns per credential "
                                       "(per edge replica); a key may carry its own")
    key_failed_verifications_per_minute: int = Field(
        30, ge=1, description="wrong secrets for one real key id per minute (per edge replica) before further tries "
        "are refused with 429 without hashing (each try costs an argon2 hash)")
    oidc_jwks_url: str | None = Field(None, description="JWKS of the OIDC issuer; unset = no JWT bearer tokens")
    oidc_issuer: str | None = Field(None, description="the tokens' required iss")
    oidc_audience: str | None = Field(None, description="the tokens' required aud")
    oidc_tenant_claim: str = Field("tenant", description="the claim that names the caller's tenant")
    oidc_algorithms: list[str] = Field(default_factory=lambda: ["RS256", "ES256"],
                                       description="accepted signature algorithms (never none/HS*)")

    @model_validator(mode="after")
    def _oidc_complete(self) -> Settings:
        if self.oidc_jwks_url and not (self.oidc_issuer and self.oidc_audience):
            raise ValueError("CTX_OIDC_JWKS_URL needs CTX_OIDC_ISSUER and CTX_OIDC_AUDIENCE")
        if any(a.lower() == "none" or a.upper().startswith("HS") for a in self.oidc_algorithms):
            raise ValueError("CTX_OIDC_ALGORITHMS takes asymmetric algorithms only (RS*, ES*, PS*, EdDSA)")
        return self
