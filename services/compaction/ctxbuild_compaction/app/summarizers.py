"""Summarizers behind one interface (SPEC §10): ``await summarizer.fold(FoldRequest) -> FoldOutcome``, and which
one a request gets (:class:`Summarizers`).

- :class:`LlmSummarizer` — through the shared provider adapters (``ctxbuild_providers``): flatten, budgets from
  ``ctxbuild_codec.summarizer_budgets``, stubbing 4000 → 1000 → 200 → 0, the omission clamp, post-processing.
- :class:`ExtractiveSummarizer` — no LLM, offline; sumy's TextRank (see ``domain/extractive.py``).
- :class:`MaskingSummarizer` — no LLM; old tool outputs become their markers, archived first when they are not
  yet (restorable). It is also the fallback when another summarizer fails (:func:`fold_with_fallback`).

A failing summarizer never fails the turn; a cancellation (the user aborted) is not a failure and propagates.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Any, Protocol

import structlog
from ctxbuild_codec import summarizer_budgets
from ctxbuild_codec.tokens import count_messages
from ctxbuild_providers import ModelRequest, Provider

from ..domain import (
    FoldOutcome,
    FoldRequest,
    apply_masking,
    build_input,
    extractive_summary,
    plan_masking,
    postprocess,
)
from ..domain.llm_input import SYSTEM

log = structlog.get_logger("compaction.summarizers")

KINDS = ("llm", "extractive", "masking")
PutText = Callable[[str, str, str | None], Awaitable[str | None]]  # (text, conversation, turn) -> uri | None


class Summarizer(Protocol):
    name: str

    async def fold(self, request: FoldRequest) -> FoldOutcome: ...


class ExtractiveSummarizer:
    name = "extractive"

    async def fold(self, request: FoldRequest) -> FoldOutcome:
        rows = request.input_rows()
        # TextRank is CPU work (quadratic in sentences): off the event loop
        summary = await asyncio.to_thread(extractive_summary, request.previous_summary, rows, request.max_chars)
        return FoldOutcome(self.name, summary=summary, input_tokens=count_messages(rows))


class MaskingSummarizer:
    """Masks the increment only: rows of an earlier fold keep their bytes (the provider's prefix cache)."""

    name = "masking"

    def __init__(self, put: PutText | None = None) -> None:
        self.put = put

    async def fold(self, request: FoldRequest) -> FoldOutcome:
        todo = plan_masking(request.rows)
        written: dict[str, str | None] = {}
        if todo and self.put is not None:
            uris = await asyncio.gather(*(self.put(t.text, request.conversation_id, request.turn_id) for t in todo))
            written = {t.sha256: uri for t, uri in zip(todo, uris, strict=True)}
        rows = apply_masking(request.rows, written)
        return FoldOutcome(self.name, rows=rows, input_tokens=count_messages(request.rows),
                           detail={"archived": sum(1 for u in written.values() if u), "toArchive": len(todo)})


class LlmSummarizer:
    name = "llm"

    def __init__(self, provider: Provider, model: str, *, window: int | None = None,
                 chat_window: int | None = None) -> None:
        self.provider = provider
        self.model = model
        self.window = window
        self.chat_window = chat_window

    def request(self, fold: FoldRequest) -> tuple[ModelRequest, dict[str, Any]]:
        out_budget, in_budget = summarizer_budgets(self.window, self.chat_window)
        built = build_input(fold.previous_summary, fold.input_rows(), in_budget)
        req = ModelRequest(model=self.model, system=SYSTEM, messages=built.messages, tools=[],
                           max_output_tokens=out_budget)
        return req, {"inputBudget": in_budget, "outputBudget": out_budget, "estimatedInputTokens": built.tokens,
                     "stub": built.stub, "omitted": built.omitted}

    async def fold(self, request: FoldRequest) -> FoldOutcome:
        req, detail = self.request(request)
        response = await self.provider.complete(req)
        text = "\n".join(p.get("text", "") for p in response.parts if p.get("type") == "text")
        usage = response.usage or {}
        return FoldOutcome(self.name, summary=postprocess(text),
                           input_tokens=int(usage.get("inputTokens") or detail["estimatedInputTokens"]),
                           output_tokens=int(usage.get("outputTokens") or 0), calls=1, detail=detail)


async def fold_with_fallback(summarizer: Summarizer, request: FoldRequest, fallback: Summarizer | None) -> FoldOutcome:
    """Run ``summarizer``; on a failure or an empty summary run ``fallback`` (masking) and say so.

    ``asyncio.CancelledError`` (an abort) is a BaseException, not caught here: it propagates to the caller.
    """
    try:
        outcome = await summarizer.fold(request)
    except Exception as exc:  # noqa: BLE001 - any summarizer failure falls back; the turn goes on
        log.warning("summarizer-failed", summarizer=summarizer.name, phase=request.phase,
                    error=f"{type(exc).__name__}: {exc}"[:300])
        outcome = FoldOutcome(summarizer.name, error=f"{type(exc).__name__}: {exc}")
    if not outcome.empty or fallback is None or fallback is summarizer:
        return outcome
    try:
        fb = await fallback.fold(request)
    except Exception as exc:  # noqa: BLE001 - the fallback failing too: report the first error, serve as is
        log.warning("fallback-failed", summarizer=fallback.name, error=f"{type(exc).__name__}: {exc}"[:300])
        return outcome
    fb.fallback_from = summarizer.name
    fb.error = outcome.error or "empty summary"
    fb.calls += outcome.calls
    fb.input_tokens += outcome.input_tokens
    return fb


@dataclass
class Choice:
    summarizer: Summarizer
    fallback: Summarizer | None
    note: str | None = None   # e.g. llm-unavailable


@dataclass
class Summarizers:
    """Which summarizer a request gets: ``settings.summarizer`` of the request, else the service default.

    ``llm`` needs a model endpoint (``provider_for(kind, model)``); without one the offline ``extractive`` is
    used and the decision says ``llm-unavailable``. Masking (archiving through ``put``) is every other
    summarizer's fallback.
    """

    default: str = "extractive"
    _: KW_ONLY
    put: InitVar[PutText | None] = None
    provider_for: Callable[[str | None, str], Provider | None] | None = None
    summarizer_provider: str | None = None
    summarizer_model: str | None = None
    summarizer_window: int | None = None
    extractive: ExtractiveSummarizer = field(init=False)
    masking: MaskingSummarizer = field(init=False)

    def __post_init__(self, put: PutText | None) -> None:
        self.extractive = ExtractiveSummarizer()
        self.masking = MaskingSummarizer(put)

    def pick(self, settings: dict[str, Any] | None) -> Choice:
        s = settings or {}
        kind = s.get("summarizer") or self.default
        if kind == "masking":
            return Choice(self.masking, None)
        if kind == "llm":
            provider_kind = self.summarizer_provider or s.get("provider")
            model = s.get("summarizerModel") or self.summarizer_model or s.get("model")
            provider = self.provider_for(provider_kind, model) if self.provider_for and model else None
            if provider is not None:
                window = s.get("summarizerWindow") or self.summarizer_window
                return Choice(LlmSummarizer(provider, model, window=window, chat_window=s.get("contextWindow")),
                              self.masking)
            return Choice(self.extractive, self.masking, "llm-unavailable")
        return Choice(self.extractive, self.masking)


def as_summarizers(s: Summarizers | Summarizer | None) -> Summarizers:
    """A picker for ``s``: the default one, ``s`` itself, or one that always picks the summarizer ``s``."""
    if s is None:
        return Summarizers()
    if isinstance(s, Summarizers):
        return s
    out = Summarizers()
    out.pick = lambda _settings: Choice(s, out.masking)  # type: ignore[method-assign]
    return out
