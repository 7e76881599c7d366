"""The turn runner: turn-start compaction → tools → step loop (in-loop compaction → provider → tools →
truncation) → persist. Resumable: everything it needs to continue is in the turn's events.

A turn is a command on the work queue (adapters/work_queue.py); whichever replica gets it calls :meth:`run`,
which folds ``turn:<id>`` (domain/turn_state.py) and continues from the first step not yet recorded:

- a step whose model call is recorded (StepServed carries the assistant message) is not asked again;
- a tool call whose result is recorded (ToolResultRecorded) is not executed again; calls of that step without a
  recorded result are executed (they never reached the log);
- the in-loop fold resumes from the last InLoopFoldRecorded checkpoint;
- events stay small: large content (assistant parts, tool inputs and outputs, the checkpoint's prefix) is stored
  as a blob of the turn and named by reference (adapters/content.py); the fold is resolved before resuming;
- the end is idempotent: the persist lane's event id and the terminal event's id are derived from the turn id,
  so two replicas racing to finish a turn complete it once.

Events are appended with the stream's expected version and stable event ids: a retry of an acknowledged append
is a no-op, a second live writer is a typed conflict (the runner then leaves the turn to the other replica).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import structlog
from ctxbuild_blobclient import content_ref
from ctxbuild_codec.budgets import compaction_budget, input_room
from ctxbuild_codec.envelopes import render_part
from ctxbuild_codec.models.subjects.ctx_turn_delta_request import TurnTextDelta
from ctxbuild_codec.tokens import count_messages, count_text
from ctxbuild_codec.turn_start import (
    TurnStartSettings,
    created_window,
    decision_time,
    plan_turn_start,
    read_window,
)
from ctxbuild_platform.errors import RemoteError, ServiceError
from ctxbuild_platform.telemetry import span
from ctxbuild_platform.text import storable
from ctxbuild_providers import ModelRequest, Provider, ProviderError, ReplayProvider, ToolSpec
from opentelemetry import context as otel_context
from opentelemetry.propagate import extract
from tenacity import AsyncRetrying, stop_after_delay, wait_exponential_jitter

from ..adapters import content
from ..adapters.backends import Backends, not_delivered, patiently, transient
from ..adapters.deltas import publish_delta
from ..adapters.turn_watch import ended_notice, publish_ended
from ..domain.arguments import argument_error, invalid_arguments_output
from ..domain.client_tools import (
    PREFIX_STREAM,
    client_calls,
    client_names,
    client_specs,
    gateway_result,
    handed_over_messages,
    input_record,
    result_summary,
    server_view,
    with_client_tools,
)
from ..domain.gateway import chain_hash, result_message
from ..domain.steps import tool_result
from ..domain.tools import BUILTINS, FS_READ, META_TOOLS, READ_FILE, WEB_TOOLS, offered_tools
from ..domain.turn_state import StepRecord, TurnState, event_id, fold, message_id
from ..domain.window_fit import fit_window

log = structlog.get_logger("runner")
SYSTEM_PROMPT = (
    "You are a careful assistant working inside ctxbuild. Large tool outputs may be shown as an excerpt with a "
    "<persisted-output> block; read the full text with fs_read when you need it."
)
COMPACTION_TIMEOUT_S = 120.0  # an llm summarizer call is a model call
TOOL_PATIENCE_S = 30.0  # a tool call's service away: retried this long before the model sees the error
FAST_COMPACTION_TIMEOUT_S = 45.0  # a fold without a model call (TextRank over a long history on a busy node)
COMPACTION_HEARTBEAT_S = 2.0  # compaction's progress interval: a replica silent for 3 of them died with the call
TERMINAL_PATIENCE_S = 600.0  # how long the terminal event is retried while persistence is away (then: handed back)
SUMMARIZER_SETTINGS = ("summarizer", "summarizerModel", "summarizerWindow")
CLAIM_MIN_BYTES = 512 * 1024  # a tool output this large goes to truncation by claim check (NATS max_payload 1 MB)
NOTICE_RESULT_MAX_BYTES = 256 * 1024  # a larger gateway answer is read from the events by the waiter
MAX_ATTEMPTS = 5  # deliveries of one turn before it is failed as poison (a runner crashed on it every time)
APPEND_BATCH_BYTES = 256 * 1024  # events of one append request (each ≤ 64 KiB): well inside one NATS message


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


class TurnTakenOver(Exception):
    """Another writer appended to this turn's stream: it owns the turn now."""


class TurnAborted(Exception):
    pass


class TurnEnded(Exception):
    """The turn already has its terminal event (written by the edge's abort or another replica)."""


class TerminalNotStored(Exception):
    """The terminal event could not be stored within the patience: the command must not be acknowledged."""


class TurnStream:
    """Appends to `turn:<id>` with optimistic concurrency and stable event ids."""

    def __init__(self, backends: Backends, turn_id: str, version: int = 0) -> None:
        self.backends = backends
        self.turn_id = turn_id
        self.stream = f"turn:{turn_id}"
        self.version = version
        self._pending: asyncio.Task | None = None
        # TurnStarted's append, started beside turn-start compaction and the first model call
        self.opening: asyncio.Task | None = None
        self._deferred: list[dict[str, Any]] = []  # written at the head of the stream's next append
        self._lazy: dict[str, Any] | None = None  # TurnStarted not written yet (:meth:`open_lazily`)
        self._now = asyncio.Event()  # write it now

    def defer(self, type_: str, data: dict[str, Any], *key: Any) -> None:
        """Record the event with the stream's next append (whichever writes next: a step's, the closing commit,
        the terminal event) instead of in an append of its own: for what nobody waits to see live, one round trip
        fewer. Lost with the attempt like an append still in flight (a resumed attempt records it again)."""
        self._deferred.append({"eventId": event_id(self.turn_id, type_, *key), "type": type_, "data": data})

    def take_deferred(self) -> list[dict[str, Any]]:
        """The deferred events, for an append about to be written (:meth:`put_back` when it was not)."""
        events, self._deferred = self._deferred, []
        return events

    def put_back(self, events: list[dict[str, Any]]) -> None:
        self._deferred = events + self._deferred

    def open_lazily(self, data: dict[str, Any], grace_s: float) -> None:
        """TurnStarted of a first attempt whose first model call is not streamed (nothing is shown while it runs):
        written only when the call outlasts ``grace_s`` or when anything else must be written or acted on first
        (:meth:`opened`, any other append); a call that answers within it with nothing to run has it ride at the
        head of the turn's closing commit instead (:meth:`ride_opening`) — one commit fewer before the answer, the
        same expected version, so an abort or another writer met there stops the attempt as it would have here."""
        self._lazy = {"eventId": event_id(self.turn_id, "TurnStarted"), "type": "TurnStarted", "data": data}
        prev = self._pending

        async def run() -> None:
            if prev is not None:
                await prev
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._now.wait(), grace_s)
            if self._take_lazy():  # first, with what was deferred meanwhile (else it rides with the closing commit)
                await self._append([])

        task = asyncio.create_task(run())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved by settle; no stray warning
        self._pending = self.opening = task

    def ride_opening(self) -> None:
        """A lazy TurnStarted not written yet goes at the head of the stream's next append (the caller's closing
        commit); none pending, or its append begun: nothing to do."""
        self._take_lazy()
        self._now.set()

    def _take_lazy(self) -> bool:
        """Move the lazy TurnStarted, if still pending, to the head of the deferred events."""
        if self._lazy is None:
            return False
        self._deferred.insert(0, self._lazy)
        self._lazy = None
        return True

    @property
    def lazily_opening(self) -> bool:
        return self._lazy is not None

    def emit_beside(self, type_: str, data: dict[str, Any], *key: Any) -> asyncio.Task:
        """Start the append and return at once: what follows runs beside it (e.g. the model call). Versions stay
        sequential: every later append of this stream — :meth:`emit`, :meth:`settle`, the terminal event — first
        awaits this one, and its failure (a conflict: :meth:`_why_moved`) surfaces there."""
        self._now.set()  # a lazy TurnStarted goes first, now
        prev = self._pending

        async def run() -> None:
            if prev is not None:
                await prev
            await self._append([{"eventId": event_id(self.turn_id, type_, *key), "type": type_, "data": data}])

        task = asyncio.create_task(run())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved by settle; no stray warning
        self._pending = task
        return task

    async def opened(self) -> None:
        """Before anything the first model call produced is streamed, recorded or acted on: TurnStarted is stored —
        the turn is this runner's (an abort or another writer met by its expected version stops the attempt here;
        the call, still running, is cancelled: :meth:`TurnRunner._complete`). Appends started after it keep
        running."""
        if self.opening is not None:
            opening, self.opening = self.opening, None
            self._now.set()  # a lazy TurnStarted is written now
            try:
                await opening
            except BaseException:
                self._deferred.clear()  # not this attempt's turn: nothing it decided is recorded
                raise

    def once_opened(self, work: Callable[..., Awaitable[Any]], *args: Any, otherwise: Any = None) -> Awaitable[Any]:
        """``work(*args)`` once TurnStarted is stored (at once when it is not pending), ``otherwise`` when it was
        not: a write beside the model call that an attempt which does not own the turn must not make. With a lazy
        TurnStarted (:meth:`open_lazily`), at once: waiting for it would put the write after the call (an attempt
        that turns out not to own the turn leaves a provisional reference the blob store's GC reclaims)."""
        opening = None if self._lazy is not None else self.opening  # taken now: :meth:`opened` clears it later

        async def run() -> Any:
            if opening is not None:
                await asyncio.wait({opening})
                if opening.cancelled() or opening.exception() is not None:
                    return otherwise
            return await work(*args)

        return run()

    async def settle(self) -> None:
        """Wait for the append started by :meth:`emit_beside` (raising what it raised)."""
        self._now.set()  # a lazy TurnStarted not taken by :meth:`ride_opening` is written now
        if self._pending is not None:
            pending, self._pending = self._pending, None
            await pending

    def abandon(self) -> None:
        """The attempt ends without settling (cancelled, failed elsewhere): an unfinished append is cancelled. Its
        expected version keeps it from landing after anything written later."""
        if self._pending is not None and not self._pending.done():
            self._pending.cancel()
        self._pending = self.opening = None

    async def emit(self, type_: str, data: dict[str, Any], *key: Any) -> None:
        await self.settle()
        await self._append([{"eventId": event_id(self.turn_id, type_, *key), "type": type_, "data": data}])

    async def emit_many(self, items: list[tuple[str, dict[str, Any], tuple[Any, ...]]]) -> None:
        """``(type, data, key)`` items in as few appends as fit (one round trip for a step's calls or results):
        the same event ids and expected versions as one :meth:`emit` each, so a retried or resumed append stores
        each event once; an append is all or nothing."""
        batch: list[dict[str, Any]] = []
        size = 0
        for type_, data, key in items:
            n = len(json.dumps(data, ensure_ascii=False))
            if batch and size + n > APPEND_BATCH_BYTES:
                await self.settle()
                await self._append(batch)
                batch, size = [], 0
            batch.append({"eventId": event_id(self.turn_id, type_, *key), "type": type_, "data": data})
            size += n
        await self.settle()
        if batch:
            await self._append(batch)

    async def _append(self, events: list[dict[str, Any]]) -> None:
        try:
            reply = await self.backends.append(self.stream, self.take_deferred() + events, expected=self.version)
        except RemoteError as exc:
            if exc.code == "version-conflict":
                raise await self._why_moved() from exc
            raise
        self.version = max(self.version, reply["toVersion"])

    async def _why_moved(self) -> Exception:
        """Someone else wrote to the turn since this runner's last event. The edge writes only
        TurnAbortRequested: that is an abort (the durable half of it — the wake-up broadcast may have been
        missed). Anything else means another replica runs the turn now."""
        page = await self.backends.read_stream(self.stream, self.version + 1)
        foreign = page["events"]
        if any(e["type"] in ("TurnCompleted", "TurnFailed") for e in foreign):
            return TurnEnded(f"{self.stream} ended meanwhile")
        if foreign and all(e["type"] == "TurnAbortRequested" for e in foreign):
            return TurnAborted(foreign[-1]["data"].get("reason") or "requested")
        return TurnTakenOver(f"{self.stream} moved past version {self.version}: "
                             f"{[e['type'] for e in foreign]}")


class HeldDeltas:
    """A step's live text deltas, sent in order by ``send``: held while the attempt's TurnStarted is not stored —
    no client sees text of an attempt that turns out not to own the turn — then sent (:meth:`release`), or
    dropped when it is not stored (:meth:`drop`)."""

    def __init__(self, send: Callable[[str], Awaitable[None]], held: bool) -> None:
        self._send = send
        self._released = not held
        self._queue: list[str] | None = []  # None: dropped
        self._sending = asyncio.Lock()  # the release and the call's next delta: one sender, in order

    async def on_text(self, text: str) -> None:
        if not text or self._queue is None:
            return
        self._queue.append(text)
        if self._released:
            await self._flush()

    async def release(self) -> None:
        self._released = True
        await self._flush()

    def drop(self) -> None:
        self._queue = None

    async def _flush(self) -> None:
        async with self._sending:
            while self._queue:
                await self._send(self._queue.pop(0))


def fixed_tokens(system: str, tools: list[ToolSpec]) -> int:
    """Tokens every request carries besides its messages (the system prompt and the tool definitions)."""
    return _fixed_text_tokens(system) + _fixed_text_tokens(json.dumps([t.as_dict() for t in tools],
                                                                      ensure_ascii=False))


@functools.lru_cache(maxsize=64)
def _fixed_text_tokens(text: str) -> int:
    # the system prompt and the tool definitions are mostly the same from turn to turn: counted once each
    return count_text(text)


def progress(phase: str, turn_id: str, d: dict[str, Any], step: int | None = None) -> dict[str, Any]:
    """CompactionDecided from a compaction decision (SPEC §8.10): a fold that happened is "done"; anything else
    is "skipped" with its reason (and the fallback that was served, if any)."""
    data = {"turnId": turn_id, "phase": phase, "status": "done" if d["status"] == "compacted" else "skipped",
            "reason": d.get("reason"), "preTokens": d.get("estimatedTokens"), "postTokens": d.get("postTokens"),
            "trigger": d.get("trigger"), "foldedCount": d.get("foldedCount")}
    for key in ("startedAt", "completedAt", "durationMs", "summarizer", "fallback", "boundaryId", "consumedCount",
                "summarizerCalls", "summarizerInputTokens", "foldInput", "room"):
        if d.get(key) is not None:
            data[key] = d[key]
    if step is not None:
        data["step"] = step
    return data


def nothing_to_fold(served: list[dict[str, Any]], fixed: int, settings: dict[str, Any]) -> bool:
    """ctx.compact.in_loop's answer known here: with no checkpoint and no message of the turn yet (its first step),
    the candidate is the turn-start window itself, and compaction serves it unchanged when folding is off, the window
    is unknown, or the candidate is within the trigger — the same budget and token counter (libs/codec) as the
    service's plan (compaction/domain/in_loop.py)."""
    if not settings.get("compressEnabled", True):
        return True
    budget = compaction_budget(settings.get("contextWindow"), settings.get("reservation"))
    return budget is None or fixed + count_messages(served) <= budget.trigger


def dialect_of(provider: Provider) -> str:
    """The wire dialect the catalog sanitizes MCP schemas for."""
    return "anthropic" if getattr(provider, "name", "") == "anthropic" else "openai"


@dataclass
class ToolBox:
    """What this turn offers and how each offered name executes."""

    specs: list[ToolSpec]
    mcp_ids: set[str]
    meta: bool  # tool_search/tool_inspect/tool_invoke are on the wire (tools deferred by the catalog)
    system_extra: str | None
    retained: dict[str, Any]  # what the served history may read (turn-start compaction): the reads' allow-list

    def spec(self, name: str) -> ToolSpec | None:
        return next((t for t in self.specs if t.name == name), None)



async def release_provisional(backends: Backends, turn_id: str) -> None:
    """After the persist lane: its in-flight blobs are promoted to the messages, and the fold checkpoints are not
    needed once the turn ends."""
    try:
        await backends.blobs.release(("turn", turn_id), "provisional")
    except RemoteError as exc:  # the refs expire with GC's grace anyway once the turn is gone
        log.warning("provisional-release-failed", turn_id=turn_id, error=str(exc))


async def keep_finished_steps(backends: Backends, st: TurnState, code: str) -> None:
    """A turn that ends without completing keeps its work (SPEC §15.4): the finished steps' messages join the
    conversation through the persist lane (idempotent by the turn's persist event id) — whoever ends it, the
    runner or the edge's abort backstop. Best effort: the terminal event matters more than the kept work."""
    cmd = st.command or {}
    if not cmd.get("userMessageId") or not st.finished_messages(cmd["userMessageId"]):
        return
    try:
        await content.resolve_steps(backends.blobs, st)
        finished = st.finished_messages(cmd["userMessageId"])
        await backends.complete_turn(cmd["conversationId"], st.turn_id, finished,
                                     (cmd.get("settings") or {}).get("truncateThreshold"),
                                     event_id=event_id(st.turn_id, "persist"))
        await release_provisional(backends, st.turn_id)
        log.info("finished-steps-kept", turn_id=st.turn_id, messages=len(finished), code=code)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the terminal event matters more than the kept work
        log.error("finished-steps-not-kept", turn_id=st.turn_id, error=f"{type(exc).__name__}: {exc}"[:300])


ProviderFactory = Callable[[dict[str, Any], str, str], Awaitable[Provider]]


@dataclass(eq=False)
class TurnRunner:
    """Runs or resumes turns from their events (one per runner process)."""

    backends: Backends
    make_provider: ProviderFactory
    _: KW_ONLY
    default_max_steps: int = 20
    keep_requests: bool = True
    web_tools: Any = None
    terminal_patience_s: float = TERMINAL_PATIENCE_S
    compaction_timeout_s: float = COMPACTION_TIMEOUT_S
    compaction_heartbeat_s: float = COMPACTION_HEARTBEAT_S
    local_turn_start_plan: bool = True  # a turn start with nothing to fold is planned here (no compaction call)
    keep_request_patience_s: float = 20.0
    # a first attempt whose first model call is not streamed writes TurnStarted only past this (or when anything
    # else is written first); answered sooner with nothing to run, TurnStarted rides with the closing commit
    lazy_turn_start_s: float = 2.0
    # a first attempt's turn-start window when its work message carried it (a conversation its command created)
    _windows: dict[str, list[dict[str, Any]]] = field(default_factory=dict, init=False, repr=False)
    # first attempts that have made nothing the blob store keeps as a provisional reference of the turn (no tool
    # output trimmed, no compaction call, no client results through the lane): nothing to release at their end
    _clean: set[str] = field(default_factory=set, init=False, repr=False)

    # ------------------------------------------------------------------ entry
    async def load(self, turn_id: str) -> TurnState:
        return fold(turn_id, await self.backends.read_stream_all(f"turn:{turn_id}"))

    async def run(self, turn_id: str, attempt: int = 1, queued: dict[str, Any] | None = None,
                  window: list[dict[str, Any]] | None = None) -> str:
        """Run or resume a turn. Returns how this attempt ended: ``completed``, ``failed``, ``already-done``,
        ``unknown`` (no TurnQueued: nothing to run), ``taken-over`` (another replica writes the turn now) or
        ``unended`` (its terminal event could not be stored: the command goes back, the turn resumes or ends on
        the next delivery). Cancellation propagates (drain: the command is handed back, another replica resumes).
        ``queued``: the TurnQueued data the work-queue message carried (the edge just recorded it as version 1):
        a first attempt starts from it without reading the stream; TurnStarted's expected version 1 checks it.
        ``window``: with it, the messages of the conversation the command's commit created — that attempt's
        turn-start window, not read back either (the same check covers it: one commit recorded both)."""
        if window and attempt == 1 and queued is not None and queued.get("turnId") == turn_id:
            self._windows[turn_id] = window
        try:
            return await self._run_attempt(turn_id, attempt, queued)
        except TurnEnded:
            return "already-done"
        except TurnTakenOver as exc:  # met while ending the turn (an append started beside the work had conflicted)
            log.warning("turn-taken-over", turn_id=turn_id, error=str(exc))
            return "taken-over"
        except TerminalNotStored as exc:
            log.error("turn-end-not-stored", turn_id=turn_id, error=str(exc)[:300])
            return "unended"
        finally:
            self._windows.pop(turn_id, None)
            self._clean.discard(turn_id)

    async def _run_attempt(self, turn_id: str, attempt: int, queued: dict[str, Any] | None = None) -> str:
        if attempt == 1 and queued is not None and queued.get("turnId") == turn_id:
            st = fold(turn_id, [{"version": 1, "type": "TurnQueued", "data": queued}])
        else:
            st = await self.load(turn_id)
        if st.done:
            return "already-done"
        if st.command is None:
            log.error("turn-unknown", turn_id=turn_id)
            return "unknown"
        # a failed read propagates: the command is not acknowledged and comes back later
        await content.resolve_steps(self.backends.blobs, st)
        cmd = st.command
        ts = TurnStream(self.backends, turn_id, st.version)
        parent_ctx = extract(cmd.get("trace") or {})
        token = otel_context.attach(parent_ctx)
        try:
            with span("turn", **{"ctx.turn_id": turn_id, "ctx.conversation_id": cmd["conversationId"],
                                 "ctx.attempt": attempt}):
                try:
                    if st.abort:
                        raise TurnAborted(st.abort.get("reason") or "aborted before it started")
                    if attempt > MAX_ATTEMPTS:
                        await self._end_failed(st, ts, "runner-crashed", f"the turn was picked up {attempt} times "
                                               "and never finished; it is failed so it cannot crash another "
                                               "replica", retryable=True)
                        return "failed"
                    if not st.started:  # beside turn-start compaction (which reads the conversation, not the turn)
                        self._clean.add(turn_id)
                        started = {"turnId": turn_id, "conversationId": cmd["conversationId"],
                                   "userMessageId": cmd["userMessageId"], "anchorId": cmd["userMessageId"]}
                        if (cmd.get("provider") or {}).get("stream") is False and self.lazy_turn_start_s > 0:
                            ts.open_lazily(started, self.lazy_turn_start_s)  # nothing is shown while it runs
                        else:
                            ts.opening = ts.emit_beside("TurnStarted", started)
                            # its request goes out first: a write, it takes longer than the turn-start read, and
                            # what the first model call produces waits for it
                            await asyncio.sleep(0)
                    else:
                        await ts.emit("TurnResumed", {"turnId": turn_id, "attempt": st.attempts + 1,
                                                      "fromStep": st.next_step}, st.attempts + 1)
                    await self._run(st, ts)
                    return "completed"
                except TurnTakenOver as exc:
                    log.warning("turn-taken-over", turn_id=turn_id, error=str(exc))
                    return "taken-over"
                except (TurnEnded, TerminalNotStored):
                    raise
                except TurnAborted as exc:
                    await self._end_failed(st, ts, "aborted", f"the turn was aborted: {exc}")
                    return "failed"
                except (RemoteError, ProviderError) as exc:
                    code = getattr(exc, "code", "provider-error")
                    log.warning("turn-failed", turn_id=turn_id, code=code, error=str(exc))
                    if isinstance(exc, RemoteError) and transient(exc) and exc.subject.startswith("ctx.persist."):
                        # persistence stayed away past the patience: hand the command back, resume later
                        raise TerminalNotStored(str(exc)) from exc
                    await self._end_failed(st, ts, code, str(exc), retryable=getattr(exc, "retryable", None))
                    return "failed"
                except ServiceError as exc:
                    await self._end_failed(st, ts, exc.code, str(exc), retryable=exc.retryable)
                    return "failed"
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.exception("turn-crashed", turn_id=turn_id)
                    await self._end_failed(st, ts, "internal", f"{type(exc).__name__}: {exc}")
                    return "failed"
        finally:
            ts.abandon()
            otel_context.detach(token)

    async def abort_now(self, turn_id: str, reason: str) -> None:
        """Record the abort of a turn this runner was running (its task was cancelled): finished steps kept, then
        the terminal event."""
        st = await self.load(turn_id)
        if not st.done:
            await self._end_failed(st, TurnStream(self.backends, turn_id, st.version), "aborted",
                                   f"the turn was aborted: {reason}")

    async def _end_failed(self, st: TurnState, ts: TurnStream, code: str, message: str,
                          retryable: bool | None = None) -> None:
        """A failed turn keeps its work (SPEC §15.4): the finished steps' messages join the conversation (the
        persist lane, idempotent by the turn's persist event id), then the terminal TurnFailed."""
        await keep_finished_steps(self.backends, st, code)
        await self._fail(ts, code, message, retryable)

    async def _fail(self, ts: TurnStream, code: str, message: str, retryable: bool | None = None) -> None:
        data = {"turnId": ts.turn_id, "code": code, "message": message[:2000]}
        if retryable is not None:
            data["retryable"] = retryable
        # same event id as TurnCompleted: a turn has exactly one terminal event whoever writes first
        await self._terminal(ts, {"eventId": event_id(ts.turn_id, "terminal"), "type": "TurnFailed", "data": data})

    async def _terminal(self, ts: TurnStream, event: dict[str, Any], result: dict[str, Any] | None = None) -> None:
        """Store the terminal event, retrying while persistence is away (SPEC §15.4: a turn always ends). Another
        terminal event already stored under the same id (``event-id-conflict``) is the turn's end too. Still not
        stored after the patience → :class:`TerminalNotStored` (the command is not acknowledged)."""
        await self._settled(ts)
        try:
            await self.backends.append(ts.stream, [*ts.take_deferred(), event], patience_s=self.terminal_patience_s)
        except RemoteError as exc:
            if exc.code == "event-id-conflict":
                log.info("turn-already-ended", turn_id=ts.turn_id)
                return
            raise TerminalNotStored(f"{event['type']} of {ts.turn_id}: {exc}") from exc
        await publish_ended(self.backends.rpc.broker, ts.turn_id, event["type"], result)  # wakes a waiting gateway

    async def _settled(self, ts: TurnStream) -> None:
        """Before the terminal event: an append started beside the work is done. One that found another writer
        ends this attempt without a terminal event (the other replica, or the turn's own end, owns it); any
        other failure of it does not keep the turn from ending."""
        try:
            await ts.settle()
        except (TurnTakenOver, TurnEnded):
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. an abort met by a progress event: the turn ends anyway
            log.info("pending-append-not-stored", turn_id=ts.turn_id, error=f"{type(exc).__name__}: {exc}"[:300])

    # ------------------------------------------------------------------ the loop
    async def _run(self, st: TurnState, ts: TurnStream) -> None:
        try:
            await self._steps(st, ts)
        except Exception:
            await ts.opened()  # TurnStarted met an abort or another writer: that explains the attempt first
            raise

    async def _steps(self, st: TurnState, ts: TurnStream) -> None:
        cmd = st.command or {}
        turn_id, conversation_id, user_message_id = st.turn_id, cmd["conversationId"], cmd["userMessageId"]
        cs: dict[str, Any] = cmd.get("settings") or {}
        max_steps = int(cmd.get("maxSteps") or self.default_max_steps)
        provider = await self.make_provider(cmd["provider"], conversation_id, turn_id)
        window = {"contextWindow": cs.get("contextWindow"), "reservation": cs.get("reservation")}
        compaction = {**window, "compressEnabled": cs.get("compressEnabled", True),
                      **{k: cs[k] for k in SUMMARIZER_SETTINGS if cs.get(k) is not None},
                      "provider": getattr(provider, "name", None), "model": getattr(provider, "model", None)}
        start = await self._turn_start(conversation_id, user_message_id, turn_id, cs, compaction)
        served: list[dict[str, Any]] = start["messages"]
        if any(m.get("turnId") == input_record(turn_id) for m in served):
            self._clean.discard(turn_id)  # client results came through the lane: its offloads are the turn's
        box = await self._toolbox(provider, cs, start["retained"], turn_id)
        clients = client_names(cmd)
        if clients:
            box.specs = with_client_tools(box.specs, client_specs(cmd))
        system = SYSTEM_PROMPT + (f"\n\n{box.system_extra}" if box.system_extra else "") + \
            (f"\n\n{cmd['system']}" if cmd.get("system") else "")  # the gateway client's own system prompt
        trunc_settings = {"truncateThreshold": cs.get("truncateThreshold"), **window}
        fixed = fixed_tokens(system, box.specs)
        room = input_room(cs.get("contextWindow"), cs.get("reservation"))
        if start["decision"].get("fallback") == "in-process" and room is not None:
            fit = fit_window(served, max(room - fixed, 0), user_message_id)
            served = fit.messages
            start["decision"].update(fallback=fit.stages, postTokens=fit.tokens, room=max(room - fixed, 0))
        if not st.turn_start_recorded:
            decided = progress("turn-start", turn_id, start["decision"])
            if start["decision"].get("status") == "serve":  # nothing was folded: written with the next append
                ts.defer("CompactionDecided", decided, "turn-start")
            else:  # a fold (or a failed one) shows live: beside the next step's model call, the next append waits
                ts.emit_beside("CompactionDecided", decided, "turn-start")
        checkpoint = st.checkpoint
        model_name = getattr(provider, "model", None) or getattr(provider, "name", "model")

        for step in range(1, max_steps + 1):
            with span("step", **{"ctx.step": step, "ctx.turn_id": turn_id}):
                if step in st.steps:
                    rec = st.steps[step]
                    if clients and client_calls(rec.assistant, clients):
                        return await self._hand_over(st, ts, step, provider, box, trunc_settings, cs, clients)
                    if not rec.complete:
                        await self._tools(st, ts, step, provider, box, trunc_settings, conversation_id)
                    if not rec.calls:
                        return await self._finish(st, ts, step, conversation_id, cs)
                    continue
                turn_messages = st.messages(user_message_id)
                if checkpoint is None and not turn_messages and nothing_to_fold(served, fixed, compaction):
                    messages = served  # what ctx.compact.in_loop would serve as is: no round trip
                else:
                    with span("compaction.in_loop", **{"ctx.step": step}):
                        messages, checkpoint = await self._in_loop(
                            conversation_id, turn_id, step, served + turn_messages, checkpoint, start["retained"],
                            fixed, compaction, ts, room, user_message_id)
                messages, served_tokens = await self._within_window(messages, room, fixed, user_message_id, ts, step)
                request = ModelRequest(model=model_name, system=system, messages=messages, tools=box.specs,
                                       max_output_tokens=cmd.get("maxOutputTokens"),
                                       tool_choice=cmd.get("toolChoice"),
                                       parallel_tool_calls=cmd.get("parallelToolCalls"),
                                       options=cmd.get("options") or {})  # the gateway client's choices
                body = request.render()
                request_hash = hashlib.sha256(body).hexdigest()
                inline = content.inline_request(body) if self.keep_requests else None
                # a blob of the turn: not written for an attempt whose TurnStarted is refused
                stored = asyncio.create_task(ts.once_opened(self._keep_request, conversation_id, turn_id, body,
                                                            otherwise={})) \
                    if self.keep_requests and inline is None else None
                if stored is not None:
                    # let the put go out first: with a fast upstream it is the longest thing before the turn's end
                    # commit, and the SDK's request building runs before the provider call yields
                    await asyncio.sleep(0)
                response, model_ms = await self._complete(provider, request, step, turn_id, ts)
                parent = turn_messages[-1]["id"] if turn_messages else user_message_id
                a_msg = {"id": message_id(turn_id, step, "a"), "parentId": parent, "role": "assistant",
                         "parts": response.parts, "turnId": turn_id}
                if response.usage:
                    a_msg["usage"] = response.usage
                served_ev: dict[str, Any] = {
                    "turnId": turn_id, "step": step, "servedTokens": served_tokens,
                    "messagesServed": len(messages), "requestHash": request_hash, "requestBytes": len(body),
                    "usage": response.usage, "modelMs": model_ms, "stopReason": response.stop_reason,
                    "assistantMessage": a_msg}
                if inline is not None:
                    served_ev["request"] = {"sha256": request_hash, "size": len(body), "body": inline}
                elif stored is not None:
                    ref = await stored
                    if "missing" in ref:
                        served_ev["requestMissing"] = ref["missing"]
                    else:
                        served_ev["request"] = ref
                served_ev["assistantMessage"] = await content.small_message(self.backends.blobs, a_msg,
                                                                            conversation_id, turn_id)
                if not response.tool_calls:  # the last step: its StepServed goes in the turn's one closing commit
                    st.steps[step] = StepRecord(step, a_msg, served_tokens=served_tokens, model_ms=model_ms)
                    return await self._finish(st, ts, step, conversation_id, cs, served=served_ev)
                await ts.emit("StepServed", served_ev, step)
                st.steps[step] = StepRecord(step, a_msg, served_tokens=served_tokens, model_ms=model_ms)
                if clients and client_calls(a_msg, clients):
                    return await self._hand_over(st, ts, step, provider, box, trunc_settings, cs, clients)
                await self._tools(st, ts, step, provider, box, trunc_settings, conversation_id)
        # keep the work: the steps so far (every call answered) join the conversation, then the typed end
        await self.backends.complete_turn(conversation_id, turn_id, st.messages(user_message_id),
                                          cs.get("truncateThreshold"), event_id=event_id(turn_id, "persist"))
        await self._release_provisional(turn_id)
        await self._fail(ts, "step-limit", f"the turn needed more than {max_steps} model calls; its {max_steps} "
                         "steps are kept in the conversation — send a follow-up message to continue", retryable=False)

    async def _complete(self, provider: Provider, request: ModelRequest, step: int, turn_id: str,
                        ts: TurnStream) -> tuple[Any, float]:
        """(The response, the call's ms.) A first attempt's first call does not wait for TurnStarted's append
        (``ts.opening``), what it produces does: its deltas are held and its response returned once TurnStarted is
        stored; refused (an abort, another writer), the call is cancelled — the SDK closes the connection — and the
        refusal raised, nothing of the call sent or recorded."""
        pending = ts.opening is not None and not ts.opening.done()
        lazy = ts.lazily_opening
        deltas = self._delta_publisher(turn_id, step, held=pending)

        async def call() -> tuple[Any, float]:
            with span("provider.call", **{"ctx.step": step, "ctx.provider": getattr(provider, "name", "")}):
                t0 = time.perf_counter()
                if isinstance(provider, ReplayProvider):  # the runner knows the step (folds shift counts)
                    response = await provider.complete(request, step=step, on_text=deltas.on_text)
                else:
                    response = await provider.complete(request, on_text=deltas.on_text)
                return response, round((time.perf_counter() - t0) * 1000, 3)

        if not pending:
            await ts.opened()  # stored already (or refused: raised here, before any model is asked)
            return await call()
        if lazy:  # TurnStarted not written yet (a call that is not streamed: TurnStream.open_lazily)
            response, ms = await call()
            if not response.tool_calls and ts.lazily_opening:
                # the answer: TurnStarted rides with the closing commit (TurnRunner._end_in_one_commit); its text
                # reaches the waiting edge in the end notice, no delta needed
                deltas.drop()
                return response, ms
            await ts.opened()  # written now (or refused: raised, nothing of the call recorded or run)
            await deltas.release()
            return response, ms
        task = asyncio.create_task(call())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a refused attempt's call: not retrieved
        try:
            try:
                await ts.opened()
            except BaseException:
                deltas.drop()
                task.cancel()
                await asyncio.wait({task})  # the call is over before the attempt ends
                raise
            await deltas.release()
            return await task
        finally:
            task.cancel()  # the attempt cancelled (drain) while the call ran; a no-op once it is done

    def _delta_publisher(self, turn_id: str, step: int, held: bool = False) -> HeldDeltas:
        """Text deltas go out on core NATS (ctx.turn.delta.<turn>) for live SSE, never to the event store: the
        step's assistant message is the durable record. Fire and forget — a lost delta costs nothing. ``held``:
        kept back until :meth:`HeldDeltas.release` (TurnStarted not stored yet)."""
        seq = 0

        async def send(text: str) -> None:
            nonlocal seq
            try:
                await publish_delta(self.backends.rpc.broker,
                                    TurnTextDelta(turnId=turn_id, step=step, seq=seq, text=text))
                seq += 1
            except Exception as exc:  # noqa: BLE001 - streaming is a courtesy, the turn must go on
                log.debug("delta-not-sent", turn_id=turn_id, error=str(exc))

        return HeldDeltas(send, held)

    async def _keep_request(self, conversation_id: str, turn_id: str, body: bytes) -> dict[str, Any]:
        """The served request, byte for byte, as a blob of the turn (its sha256 is the StepServed requestHash):
        what the model saw stays inspectable. Retried with backoff for ``keep_request_patience_s`` (the blob
        store or S3 away for a moment: the write runs beside the model call, so a short outage costs nothing);
        still failing → ``{"missing": reason}``, recorded in StepServed as ``requestMissing``. A failed write
        never fails the step."""
        try:
            async for attempt in AsyncRetrying(stop=stop_after_delay(self.keep_request_patience_s),
                                               wait=wait_exponential_jitter(initial=0.25, max=4.0), reraise=True):
                with attempt:
                    r = await self.backends.blob_client.put(body, conversation_id, ("turn", turn_id), "tool_output",
                                                      media_type="application/json")
            return {"sha256": r["sha256"], "size": r["size"]}
        except Exception as exc:  # noqa: BLE001 - observability must not fail the turn
            log.warning("served-request-not-kept", turn_id=turn_id, error=str(exc)[:300])
            return {"missing": f"{type(exc).__name__}: {exc}"[:500]}

    async def _finish(self, st: TurnState, ts: TurnStream, steps: int, conversation_id: str,
                      cs: dict[str, Any], served: dict[str, Any] | None = None) -> None:
        """The turn completes in ONE commit: the persist lane stores its messages on the conversation together with
        the turn's last StepServed (``served``: the step just answered, not yet recorded) and TurnCompleted on the
        turn stream (``turnAppend``: both or neither; a crash before it leaves the step unrecorded, and the resumed
        attempt asks the model again, as for any step whose StepServed is missing). The gateway prefix record runs
        beside it; the end notice waits for both; the provisional references are released after the end (the persist
        lane promoted what the messages name; a release that never happens only waits for GC's grace).
        A conflict on the turn stream (an abort, another writer) or a persistence that does not know ``turnAppend``
        → the serial path: StepServed, the messages, then the terminal event on its own."""
        cmd = st.command or {}
        messages = st.messages(cmd["userMessageId"])
        text = "".join(p.get("text", "") for p in messages[-1]["parts"] if p.get("type") == "text") \
            if messages else ""
        answer = await content.small_value(self.backends.blobs, text, conversation_id, st.turn_id)
        terminal = {"eventId": event_id(st.turn_id, "terminal"), "type": "TurnCompleted",
                    "data": {"turnId": st.turn_id, "steps": steps, "answer": answer,
                             "messageIds": [m["id"] for m in messages]}}
        await self._close(st, ts, conversation_id, messages, cs, served, terminal, frozenset())

    async def _close(self, st: TurnState, ts: TurnStream, conversation_id: str, messages: list[dict[str, Any]],
                     cs: dict[str, Any], served: dict[str, Any] | None, terminal: dict[str, Any],
                     pending: frozenset[str]) -> None:
        record, summary = self._gateway_answer(st, messages, pending)
        try:
            ended = await self._end_in_one_commit(st, ts, conversation_id, messages, cs, served, terminal,
                                                  [record] if record is not None else [], summary)
        except BaseException:
            if served is not None:  # not recorded: a failed turn must not keep the step's answer (SPEC §15.4)
                st.steps.pop(served["step"], None)
            raise
        if not ended:
            if served is not None:
                await self._record_served(st, ts, served)
            await self.backends.complete_turn(conversation_id, st.turn_id, messages, cs.get("truncateThreshold"),
                                              event_id=event_id(st.turn_id, "persist"))
            if record is not None and not await self._record_answer_prefix(st.turn_id, record):
                summary = None
        if not ended:
            await self._terminal(ts, terminal, summary)
        if st.turn_id not in self._clean:
            await self._release_provisional(st.turn_id)

    async def _end_in_one_commit(self, st: TurnState, ts: TurnStream, conversation_id: str,
                                 messages: list[dict[str, Any]], cs: dict[str, Any], served: dict[str, Any] | None,
                                 terminal: dict[str, Any], also: list[dict[str, Any]],
                                 summary: dict[str, Any] | None) -> bool:
        """True: the messages, the last StepServed, TurnCompleted and ``also`` (a gateway answer's prefix record)
        are stored (one commit) and the end notice (``summary``: a gateway turn's result) is sent — by persistence
        right after the commit (``endNotice``, one hop less to the waiting edge), else from here. False: nothing of
        it is (a conflict — the answer's prefix recorded first by another turn, too — or a persistence without
        ``turnAppend``): the caller takes the serial path."""
        ts.ride_opening()  # a lazy TurnStarted not written yet heads this commit
        await ts.settle()  # appends started beside the work come first (versions are sequential)
        deferred = ts.take_deferred()
        events = [*deferred, *([{"eventId": event_id(st.turn_id, "StepServed", served["step"]), "type": "StepServed",
                                 "data": served}] if served is not None else [])]
        events.append(terminal)
        try:
            notice: dict[str, Any] | None = ended_notice(st.turn_id, terminal["type"], summary)
        except ValueError as exc:  # a summary that does not fit the notice: the waiter reads the turn's events
            log.warning("end-notice-invalid", turn_id=st.turn_id, error=str(exc)[:200])
            notice = summary = None
        try:
            reply = await self.backends.complete_turn(
                conversation_id, st.turn_id, messages, cs.get("truncateThreshold"),
                event_id=event_id(st.turn_id, "persist"),
                turn_append={"streamId": ts.stream, "expectedVersion": ts.version, "events": events},
                also_append=also, end_notice=notice)
        except RemoteError as exc:
            if exc.code in ("version-conflict", "event-id-conflict", "invalid-payload"):
                log.info("turn-end-serial", turn_id=st.turn_id, code=exc.code, error=str(exc)[:200])
                ts.put_back(deferred)
                return False
            raise
        if "turnAppend" not in reply or (also and "alsoAppend" not in reply):
            # an older persistence ignored them: nothing of the turn stream was written
            ts.put_back(deferred)
            return False
        ts.version = max(ts.version, reply["turnAppend"]["toVersion"])
        if reply.get("endNoticeSent") is not True:  # an older persistence, or its publish failed
            await publish_ended(self.backends.rpc.broker, st.turn_id, terminal["type"], summary)
        return True

    async def _record_served(self, st: TurnState, ts: TurnStream, served: dict[str, Any]) -> None:
        """StepServed on its own (the serial path); not stored → the step is not the turn's either."""
        try:
            await ts.emit("StepServed", served, served["step"])
        except BaseException:
            st.steps.pop(served["step"], None)
            raise

    async def _hand_over(self, st: TurnState, ts: TurnStream, step: int, provider: Provider, box: ToolBox,
                         trunc_settings: dict[str, Any], cs: dict[str, Any], clients: frozenset[str]) -> None:
        """A step called client tools (gateway, SPEC §15.5): its server-side calls run and are recorded here as
        usual, the client's are not run — the turn completes with them pending (stopReason ``tool_calls``), the
        step's assistant message and its server-side results are stored, and the client's results continue the
        conversation under them on its next request."""
        cmd = st.command or {}
        conversation_id = cmd["conversationId"]
        rec = st.steps[step]
        st.steps[step] = StepRecord(step, server_view(rec.assistant, clients), rec.results, rec.requested)
        try:  # the same execution, truncation and records as any step, over the server-side calls only
            await self._tools(st, ts, step, provider, box, trunc_settings, conversation_id)
        finally:
            st.steps[step] = rec
        messages = handed_over_messages(st, cmd["userMessageId"], step, clients)
        pending = [c["toolCallId"] for c in client_calls(rec.assistant, clients)]
        text = "".join(p.get("text", "") for p in rec.assistant["parts"] if p.get("type") == "text")
        answer = await content.small_value(self.backends.blobs, text, conversation_id, st.turn_id)
        terminal = {"eventId": event_id(st.turn_id, "terminal"), "type": "TurnCompleted",
                    "data": {"turnId": st.turn_id, "steps": step, "answer": answer,
                             "messageIds": [m["id"] for m in messages], "stopReason": "tool_calls",
                             "pendingToolCalls": pending}}
        await self._close(st, ts, conversation_id, messages, cs, None, terminal, frozenset(pending))

    @staticmethod
    def _gateway_answer(st: TurnState, messages: list[dict[str, Any]], pending: frozenset[str]
                        ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """A gateway turn (TurnQueued.gatewayChain) ends: (the answer's prefix record — the assistant message the
        client will resend, naming the turn's last message — as an append stored in the turn's closing commit, so
        the client's next request finds the conversation at once; the response's summary for the end notice).
        The record is None when not a gateway turn; the summary when not a gateway turn or when it is large (the
        waiter then reads the events)."""
        chain = (st.command or {}).get("gatewayChain")
        if not chain or not messages:
            return None, None
        result = gateway_result(st, pending)
        record = {"streamId": PREFIX_STREAM + chain_hash(chain, result_message(result)), "expectedVersion": 0,
                  "events": [{"eventId": event_id(st.turn_id, "gateway-prefix"), "type": "GatewayPrefixRecorded",
                              "data": {"conversationId": (st.command or {})["conversationId"],
                                       "messageId": messages[-1]["id"]}}]}
        summary = result_summary(st, result)
        return record, summary if len(json.dumps(summary, ensure_ascii=False)) <= NOTICE_RESULT_MAX_BYTES else None

    async def _record_answer_prefix(self, turn_id: str, record: dict[str, Any]) -> bool:
        """The serial path's prefix record, on its own: recorded already (another turn gave the same answer to the
        same conversation) is fine, first writer wins. False when it could not be written (the waiter records it)."""
        try:
            await self.backends.append(record["streamId"], record["events"], expected=record["expectedVersion"])
        except RemoteError as exc:
            if exc.code not in ("version-conflict", "event-id-conflict"):
                log.warning("gateway-prefix-not-recorded", turn_id=turn_id, error=str(exc)[:300])
                return False
        return True

    async def _release_provisional(self, turn_id: str) -> None:
        await release_provisional(self.backends, turn_id)

    # ------------------------------------------------------------------ tools
    async def _toolbox(self, provider: Provider, cs: dict[str, Any], retained: dict[str, Any],
                       turn_id: str) -> ToolBox:
        mcp_tools: list[dict[str, Any]] = []
        wire: dict[str, Any] | None = None
        if cs.get("mcpMode", "manual") != "disabled" and (cs.get("mcpServers") or cs.get("mcpMode") == "auto"):
            resolved = await patiently(lambda: self.backends.resolve_tools(
                cs.get("mcpMode", "manual"), cs.get("mcpServers", []), dialect=dialect_of(provider),
                context_window=cs.get("contextWindow"), turn_id=turn_id),
                within_s=min(self.backends.patience_s, TOOL_PATIENCE_S), what="mcp resolve")  # idempotent
            mcp_tools, wire = resolved["tools"], resolved.get("wire")
        extra: list[ToolSpec] = []
        if self.web_tools is not None and cs.get("webTools", True):
            extra.extend(self.web_tools.specs())
        extra.extend(getattr(provider, "recorded_tools", None) or [])
        if wire is not None:
            wire_specs = [ToolSpec(t["name"], t.get("description", ""), t.get("inputSchema") or {"type": "object"})
                          for t in wire["tools"]]
            specs = offered_tools(retained, [], can_offload=True, others=extra + wire_specs)
            return ToolBox(specs, {t["id"] for t in mcp_tools}, any(t.name in META_TOOLS for t in wire_specs),
                           wire.get("systemPrompt"), retained)
        specs = offered_tools(retained, mcp_tools, can_offload=True, others=extra)
        return ToolBox(specs, {t["id"] for t in mcp_tools}, False, None, retained)

    async def _tools(self, st: TurnState, ts: TurnStream, step: int, provider: Provider, box: ToolBox,
                     trunc_settings: dict[str, Any], conversation_id: str) -> None:
        """Execute the step's calls that have no recorded result, truncate them, record them (one event each; the
        step's requests in one append before the first call runs, its results in one append)."""
        rec = st.steps[step]
        todo = [c for c in rec.calls if c["toolCallId"] not in rec.results]
        requested: list[tuple[str, dict[str, Any], tuple[Any, ...]]] = []
        for call in todo:
            if call["toolCallId"] not in rec.requested:
                args = await content.small_value(self.backends.blobs, call.get("input") or {}, conversation_id,
                                                 st.turn_id)
                requested.append(("ToolCallRequested", {"turnId": st.turn_id, "step": step,
                                                        "toolCallId": call["toolCallId"], "toolName": call["toolName"],
                                                        "input": args}, (step, call["toolCallId"])))
        await ts.emit_many(requested)
        rec.requested.update(data["toolCallId"] for _, data, _ in requested)
        results: list[dict[str, Any]] = []
        for call in todo:
            with span("tool", **{"ctx.tool": call["toolName"], "ctx.step": step}):
                output, effective = await self._execute(conversation_id, st.turn_id, call, box, provider)
            output = storable(output)
            results.append(tool_result(call, output, effective))
        if not results:
            return
        with span("truncation.step", **{"ctx.step": step}):
            trimmed = await self._truncate(conversation_id, st.turn_id, trunc_settings, results)
        recorded: list[tuple[str, dict[str, Any], tuple[Any, ...]]] = []
        for part in trimmed:
            output = await content.small_value(self.backends.blobs, part["output"], conversation_id, st.turn_id)
            data = {"turnId": st.turn_id, "step": step, "toolCallId": part["toolCallId"],
                    "toolName": part["toolName"], "output": output, "trimmed": "offload" in part}
            if part.get("effectiveToolName"):
                data["effectiveToolName"] = part["effectiveToolName"]
            if "offload" in part:
                data["offload"] = part["offload"]
            recorded.append(("ToolResultRecorded", data, (step, part["toolCallId"])))
        await ts.emit_many(recorded)
        for part in trimmed:
            rec.results[part["toolCallId"]] = part

    async def _truncate(self, conversation_id: str, turn_id: str, settings: dict[str, Any],
                        results: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """ctx.truncate.step; outputs too large for one NATS message go by claim check (stored first, owned by the
        turn as provisional). Truncation unavailable → the full outputs (better fat than lost)."""
        self._clean.discard(turn_id)  # the truncation service offloads as provisional references of the turn
        parts, claims = [], []
        for i, part in enumerate(results):
            out = part["output"]
            value = out.get("value") if out.get("type") in ("text", "error-text") else None
            if isinstance(value, str) and len(value) * 4 > CLAIM_MIN_BYTES \
                    and len(value.encode("utf-8", "surrogatepass")) > CLAIM_MIN_BYTES:
                try:
                    stored = await self.backends.blobs.put(value, conversation_id, ("turn", turn_id), "provisional")
                    claims.append({"part": i, "sha256": stored["sha256"], "size": stored["size"]})
                    part = {**part, "output": {"type": out["type"], "value": ""}}
                except RemoteError as exc:
                    log.warning("claim-put-failed", turn_id=turn_id, error=str(exc))
            parts.append(part)
        try:
            return (await self.backends.truncate_step(conversation_id, turn_id, settings, parts, claims))["parts"]
        except RemoteError as exc:
            if claims:
                raise  # the outputs are in the blob store, not here: nothing to fall back to inline
            log.warning("truncation-unavailable", turn_id=turn_id, error=str(exc))
            return results

    async def _execute(self, conversation_id: str, turn_id: str, call: dict[str, Any], box: ToolBox,
                       provider: Provider) -> tuple[dict[str, Any], str | None]:
        """(output, effectiveToolName). Tool failures are outputs the model can read, never turn failures."""
        name, args = call["toolName"], call.get("input") or {}
        recorded = getattr(provider, "recorded_output", None)
        if recorded is not None:
            out = recorded(call["toolCallId"])
            if out is not None:
                return out, None
        spec = self._checked_spec(name, box)
        if spec is not None:  # arguments are data: checked before anything runs, identity never taken from them
            error = argument_error(name, spec.input_schema, args)
            if error is not None:
                log.info("tool-arguments-refused", turn_id=turn_id, tool=name, error=error)
                return invalid_arguments_output(error), None
        try:
            # reads are idempotent: retried while the blob store is away; a tool call only when it reached no one
            # (no responders: nothing ran) — a timed-out call may have run, and a tool may not be idempotent
            reads = unsent = min(self.backends.patience_s, TOOL_PATIENCE_S)
            if name == "read_file":
                r = await patiently(lambda: self.backends.read_file(conversation_id, turn_id, args, box.retained),
                                    within_s=reads, what="read_file")
                return {"type": "error-text" if "error" in r else "text", "value": r["modelText"]}, None
            if name == "fs_read":
                r = await patiently(lambda: self.backends.fs_read(conversation_id, turn_id, args, box.retained),
                                    within_s=reads, what="fs_read")
                return {"type": "error-text" if r.get("kind") == "error" else "text", "value": r["modelText"]}, None
            if box.meta and name in META_TOOLS:
                r = await patiently(lambda: self.backends.meta(turn_id, name, args, call["toolCallId"]),
                                    within_s=unsent, what=name, when=not_delivered)
                return r["output"], r.get("effectiveToolName")
            if name in box.mcp_ids:
                r = await patiently(lambda: self.backends.invoke(name, args, call["toolCallId"], turn_id),
                                    within_s=unsent, what=name, when=not_delivered)
                return r["output"], None
            if self.web_tools is not None and box.spec(name) is not None:
                out = await self.web_tools.execute(name, args)
                if out is not None:
                    return out, None
        except RemoteError as exc:
            return {"type": "error-text", "value": f"[Error: {exc.code}] {exc.remote_message}"}, None
        known = sorted({t.name for t in box.specs} | BUILTINS)
        return {"type": "error-text", "value": f"[Error: unknown-tool] {name} is not available; tools: {known}"}, None

    def _checked_spec(self, name: str, box: ToolBox) -> ToolSpec | None:
        """The schema a call's arguments are checked against: the built-ins' own, the offered meta-tool and web
        tool schemas (as on the wire). MCP tools are validated by the catalog's servers."""
        if name in BUILTINS:
            return READ_FILE if name == "read_file" else FS_READ
        if (box.meta and name in META_TOOLS) or (self.web_tools is not None and name in WEB_TOOLS):
            return box.spec(name)
        return None

    async def _within_window(self, messages: list[dict[str, Any]], room: int | None, fixed: int, task_id: str,
                             ts: TurnStream, step: int) -> tuple[list[dict[str, Any]], int]:
        """The last guard before the provider (SPEC §15.4): whatever compaction answered (or its fallback), a
        request over the window is fitted in-process here and the fit recorded — the provider would refuse it."""
        tokens = count_messages(messages)
        if room is None or tokens <= max(room - fixed, 0):
            return messages, tokens
        fit = fit_window(messages, max(room - fixed, 0), task_id)
        log.warning("request-over-window", turn_id=ts.turn_id, step=step, before=tokens, after=fit.tokens,
                    room=room - fixed, stages=fit.stages)
        await ts.emit("CompactionDecided", progress("in-loop", ts.turn_id, {
            "status": "skipped", "reason": "over-window: the request was fitted before serving",
            "estimatedTokens": tokens, "postTokens": fit.tokens, "fallback": fit.stages,
            "room": max(room - fixed, 0)}, step), "guard", step)
        return fit.messages, fit.tokens

    def _compaction_timeout(self, settings: dict[str, Any]) -> float:
        """Sized per call: a fold by a summarizer without a model (extractive, masking) takes moments; an llm fold
        (or the service's default, unknown here) may take a model call's time. A replica that died with the request
        costs far less: the calls ask for heartbeats (``compaction_heartbeat_s``), and silence is ``unavailable``."""
        if settings.get("summarizer") in ("extractive", "masking"):
            return min(self.compaction_timeout_s, FAST_COMPACTION_TIMEOUT_S)
        return self.compaction_timeout_s

    async def _turn_start(self, conversation_id: str, user_message_id: str, turn_id: str, cs: dict[str, Any],
                          compaction: dict[str, Any]) -> dict[str, Any]:
        """What the turn serves first (SPEC §8): planned here when nothing needs folding, else (a fold, or the
        window not readable here) ctx.compact.turn_start; compaction away → the window fitted in-process."""
        settings = {**compaction, "maxMessages": cs.get("maxMessages")}
        with span("compaction.turn_start") as turn_start_span:
            hist = None
            if self.local_turn_start_plan:
                start, hist = await self._plan_turn_start(conversation_id, user_message_id, turn_id, settings,
                                                          turn_start_span)
                if start is not None:
                    return start
            self._clean.discard(turn_id)  # a fold may keep what it made as provisional references of the turn
            try:
                return await self.backends.rpc.call("ctx.compact.turn_start", {
                    "conversationId": conversation_id, "anchorId": user_message_id, "turnId": turn_id,
                    "settings": settings},
                    timeout=self._compaction_timeout(cs), heartbeat_s=self.compaction_heartbeat_s)
            except RemoteError as exc:
                if not transient(exc):
                    raise
                # compaction away: the window's history straight from persistence, fitted in-process by the caller
                log.warning("turn-start-compaction-unavailable", turn_id=turn_id, error=str(exc)[:300])
                return await self._turn_start_fallback(conversation_id, user_message_id, cs, str(exc), hist)

    async def _plan_turn_start(self, conversation_id: str, user_message_id: str, turn_id: str,
                               settings: dict[str, Any], turn_start_span: Any
                               ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """(What ctx.compact.turn_start would answer, the window read), planned here when it needs no fold (almost
        every turn): the turn-start window read from persistence and planned by the same code as the compaction
        service (ctxbuild_codec.turn_start) — no compaction round trip. No answer: a fold is needed (only the
        compaction service summarizes; it reads the window again; the window read here is the in-process
        fallback's should compaction be away), or the window could not be read (the caller asks compaction as
        before, whose own read, or the caller's fallback, handles it)."""
        started, t0 = decision_time(), time.monotonic()
        carried = self._windows.pop(turn_id, None)
        if carried and carried[-1]["id"] == user_message_id and not settings.get("maxMessages"):
            hist = created_window(conversation_id, carried)
        else:
            try:
                hist = await read_window(lambda req: self.backends.rpc.call("ctx.persist.history", req),
                                         conversation_id, user_message_id, max_messages=settings.get("maxMessages"))
            except RemoteError as exc:
                log.warning("turn-start-history-unavailable", turn_id=turn_id, error=str(exc)[:300])
                return None, None
        plan = plan_turn_start(hist, TurnStartSettings.from_payload(settings))
        if plan.fold is not None:
            return None, hist
        d = {**plan.decision, "startedAt": started, "completedAt": decision_time(),
             "durationMs": int((time.monotonic() - t0) * 1000)}
        turn_start_span.set_attribute("ctx.compaction.status", d["status"])
        turn_start_span.set_attribute("ctx.compaction.estimated_tokens", d["estimatedTokens"])
        turn_start_span.set_attribute("ctx.compaction.planned_by", "runner")
        log.info("turn-start-decision", conversation_id=conversation_id, turn_id=turn_id, status=d["status"],
                 reason=d["reason"], estimated_tokens=d["estimatedTokens"], planned_by="runner")
        return {**plan.reply(), "decision": d}, hist

    async def _turn_start_fallback(self, conversation_id: str, user_message_id: str, cs: dict[str, Any],
                                   why: str, hist: dict[str, Any] | None = None) -> dict[str, Any]:
        """What ctx.compact.turn_start would serve, without compaction: the turn-start window of the history
        (persistence ends the walk at the deepest boundary or clear-context marker; ``hist``: already read),
        stored envelopes rendered as served; the caller fits it to the window (domain/window_fit.py)."""
        if hist is None:
            hist = await read_window(
                lambda req: patiently(lambda: self.backends.rpc.call("ctx.persist.history", req),
                                      within_s=self.backends.patience_s, what="history (turn-start fallback)"),
                conversation_id, user_message_id, max_messages=cs.get("maxMessages"))
        messages, uris, attachments = hist["messages"], hist.get("persistedUris") or [], hist.get("attachments") or []
        served = [{k: v for k, v in m.items() if k in ("id", "parentId", "role", "parts", "turnId")}
                  | {"parts": [render_part(p) if p.get("type") == "tool-result" else p for p in m.get("parts", [])]}
                  for m in messages]
        retained = {"fileAttachments": [{k: a[k] for k in ("sha256", "handle", "displayName")} for a in attachments],
                    "persistedUris": uris}
        decision = {"status": "skipped", "phase": "turn-start", "reason": f"compaction-unavailable: {why}"[:500],
                    "estimatedTokens": count_messages(served), "fallback": "in-process"}
        return {"messages": served, "retained": retained, "decision": decision}

    async def _in_loop(self, conversation_id: str, turn_id: str, step: int, full: list[dict[str, Any]],
                       checkpoint: dict[str, Any] | None, retained: dict[str, Any], fixed: int,
                       settings: dict[str, Any], ts: TurnStream, room: int | None = None,
                       task_id: str | None = None) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """What step ``step`` serves: ctx.compact.in_loop on the turn's candidate (only the messages the
        checkpoint has not consumed travel; a large compacted prefix travels by reference, compaction resolves it).
        A new checkpoint is made durable here — the runner is the turn stream's only writer — as
        InLoopFoldRecorded, and every fold (or failed fold) as CompactionDecided."""
        offset = checkpoint["consumedCount"] if checkpoint else 0
        self._clean.discard(turn_id)  # checkpoints are provisional references of the turn
        try:
            reply = await self.backends.rpc.call("ctx.compact.in_loop", {
                "conversationId": conversation_id, "turnId": turn_id, "step": step, "offset": offset,
                "messages": full[offset:], "checkpoint": checkpoint, "retained": retained, "fixedTokens": fixed,
                "settings": settings}, timeout=self._compaction_timeout(settings),
                heartbeat_s=self.compaction_heartbeat_s)
        except RemoteError as exc:
            # compaction unavailable: the candidate as the last checkpoint has it, fitted to the window in-process
            # (masking, excerpts, oldest groups dropped) — never a request the provider would refuse. The
            # checkpoint is unchanged: the next step asks compaction again.
            log.warning("in-loop-compaction-unavailable", turn_id=turn_id, step=step, error=str(exc)[:300])
            prefix = await content_ref.resolve(self.backends.blobs, checkpoint["compactedPrefix"],
                                               conversation_id) if checkpoint else []
            candidate = [*prefix, *full[offset:]]
            if room is None:
                return candidate, checkpoint
            fit = fit_window(candidate, max(room - fixed, 0), task_id)
            if fit.tokens != fit.before or fit.tokens > room - fixed:
                log.warning("in-process-fallback", turn_id=turn_id, step=step, before=fit.before, after=fit.tokens,
                            room=room - fixed, stages=fit.stages)
            await ts.emit("CompactionDecided", progress("in-loop", turn_id, {
                "status": "skipped", "reason": f"compaction-unavailable: {exc.code}", "estimatedTokens": fit.before,
                "postTokens": fit.tokens, "fallback": fit.stages, "room": max(room - fixed, 0)}, step),
                "in-loop", step)
            return fit.messages, checkpoint
        new = reply["checkpoint"]
        if reply["checkpointChanged"]:
            new = await content.small_checkpoint(self.backends.blobs, new, conversation_id, turn_id)
            await ts.emit("InLoopFoldRecorded", {"turnId": turn_id, **new, "step": step}, step)
        d = reply["decision"]
        if d["status"] != "serve":
            await ts.emit("CompactionDecided", progress("in-loop", turn_id, d, step), "in-loop", step)
        return reply["messages"], new
