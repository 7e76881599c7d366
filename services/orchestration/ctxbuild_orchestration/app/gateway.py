"""The drop-in gateway's use cases (SPEC §15.5): a request in either dialect, already parsed into the neutral form
(domain/gateway), becomes a turn on the durable path — and its result goes back to the client.

1. Identity: an explicit conversation id (header or metadata; the caller's tenant only), else the longest prefix
   of the request's hash chain (``prefix_hashes``) recorded before. Each recorded prefix is one persistence stream
   ``gwprefix:<hash>`` holding one GatewayPrefixRecorded (first writer wins) that names the stored message the
   prefix ends at; the tenant seeds the chain, so tenants never share a prefix. The messages after the matched
   prefix are new: they hang under that message — the end of the conversation, or an earlier message when the
   client edited one (a branch). Nothing matched: a new conversation, its window from the model table. A request
   with no answer in it (a first message, mostly) is taken for new without a lookup: its prefix records go in the
   admission's commit, which must create them, so the commit finds a recorded one (a retry) and it is looked up then.
2. The turn is admitted (one running turn per conversation, the key's running-turn limit) and queued like any
   other, the client's tools, tool choice and system prompt in its command (TurnQueued); the runner offers the
   client's tools beside ctxbuild's own and ends the turn when the model calls one of them. The admission, a new
   conversation's creation, the new messages, their prefix records and the command are ONE commit
   (``ctx.persist.append_batch``): a refused admission (409) stores none of them, and a message is never findable
   by its prefix before it is stored. Its work-queue message goes with that commit: persistence publishes it right
   after the commit, the edge only when it did not (the lane's path below submits after the lane, as before).
3. New messages with client tool results are stored through the persist lane instead (one call, idempotent by
   the turn; after the admission, before the submit), the results trimmed by the in-flight lane first
   (``ctx.truncate.step``, offloads owned by the turn until the lane promotes them to the message), so every later
   request renders them as the model first saw them.
4. The waiter subscribes to the turn's live deltas and its end notice before queueing (adapters/turn_watch.py),
   so nothing is missed and nothing is polled; the terminal event is read once, the result assembled from the
   turn's events, and the produced answer's prefix recorded before the client gets it (its next request finds
   the conversation).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from ctxbuild_blobclient import content_ref
from ctxbuild_platform.errors import RemoteError, ServiceError
from fastapi import HTTPException

from ..adapters import content
from ..adapters.backends import new_event
from ..adapters.turn_watch import TurnWatch
from ..domain.client_tools import PREFIX_STREAM, gateway_result, input_record
from ..domain.gateway import (
    DialectError,
    GatewayRequest,
    GatewayResult,
    chain_hash,
    prefix_hashes,
    result_message,
)
from ..domain.keys import Principal
from ..domain.turn_state import TERMINAL, event_id, fold
from .edge import Edge, bad_text_at, safe_text
from .runner import new_id

log = structlog.get_logger("gateway")
CONVERSATION_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]*")  # the API's path id pattern (routers/common.py)
ENDED_KEPT = 10_000  # conversations whose last turn's end this replica remembers (admission without reads)
BATCH_MAX_GROUPS = 64  # streams one ctx.persist.append_batch may name
BACKSTOP_S = 2.0  # a lost end notice (core NATS) costs at most this long: then the turn's stream is read


@dataclass(frozen=True)
class ModelEntry:
    name: str
    dialect: str  # the upstream's wire format
    context_window: int
    upstream_model: str
    summarizer: str | None = None
    owned_by: str = "ctxbuild"


@dataclass(frozen=True)
class GatewayConfig:
    models: dict[str, ModelEntry]
    passthrough: bool = True
    default_context_window: int = 128_000
    summarizer: str | None = None
    web_tools: bool = False
    mcp_mode: str = "manual"
    max_steps: int = 20
    wait_s: float = 600.0

    @classmethod
    def from_settings(cls, s: Any) -> GatewayConfig:
        models = {name: ModelEntry(name, m.dialect, m.contextWindow, m.upstreamModel or name, m.summarizer,
                                   m.ownedBy) for name, m in s.gateway_models.items()}
        return cls(models, s.gateway_passthrough, s.gateway_default_context_window, s.gateway_summarizer,
                   s.gateway_web_tools, s.gateway_mcp_mode, s.gateway_max_steps, s.gateway_wait_s)


@dataclass
class Started:
    """A request admitted and queued: what the response needs."""

    request: GatewayRequest
    conversation_id: str
    turn_id: str
    chain: str  # the hash of the request's whole conversation (the answer's prefix extends it)
    watch: TurnWatch
    t0: float
    records: asyncio.Task | None = None  # the new messages' prefix records (durable before the response ends)
    created: bool = False
    who: Principal | None = None
    admission: int = 0  # the version of the turn's admission (conversation-turns:<id>)
    notice: dict[str, Any] | None = None  # the end notice (TurnEndedNotice): a completed turn's summary in it


@dataclass
class Finished:
    result: GatewayResult | None
    error: dict[str, Any] | None  # {status, message, code} of a failed turn
    served_tokens: int = 0
    upstream_ms: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)


def turn_failure_status(code: str | None, retryable: bool | None) -> int:
    """A failed turn as the client's HTTP status: the upstream's failure is a gateway error (502, 503 when it
    may pass), anything else ours (500, 503 when it may pass)."""
    if retryable:
        return 503
    return 502 if code == "provider-error" else 500


class Gateway:
    def __init__(self, edge: Edge, config: GatewayConfig, check_provider: Callable[[dict[str, Any]], None]) -> None:
        self.edge, self.config, self.check_provider = edge, config, check_provider
        self.backends = edge.backends
        self.tasks: set[asyncio.Task] = set()
        # conversation → the admission version of its last turn this replica saw end: the next request's admission
        # is appended right after it, without reading (a conflict reads the stream as usual)
        self.ended: OrderedDict[str, int] = OrderedDict()

    # ---------- the model table
    def model(self, name: str, dialect: str) -> ModelEntry:
        entry = self.config.models.get(name)
        if entry is None and self.config.passthrough:
            entry = ModelEntry(name, dialect, self.config.default_context_window, name)
        if entry is None:
            raise DialectError(404, "not_found_error" if dialect == "anthropic" else "invalid_request_error",
                               f"The model `{name}` does not exist or you do not have access to it.", "model")
        try:
            self.check_provider({"kind": entry.dialect, "model": entry.upstream_model})
        except ServiceError as exc:
            raise DialectError(404, "not_found_error" if dialect == "anthropic" else "invalid_request_error",
                               f"The model `{name}` is not available here: {exc.message}", "model") from exc
        return entry

    def listing(self) -> list[ModelEntry]:
        return list(self.config.models.values())

    # ---------- identity
    async def _prefix(self, digest: str) -> dict[str, Any] | None:
        page = await self.backends.read_stream(PREFIX_STREAM + digest, 1, limit=1)
        return page["events"][0]["data"] if page["events"] else None

    async def _record(self, digest: str, conversation_id: str, message_id: str, index: int) -> None:
        """First writer wins: the same prefix recorded twice (a retried request) keeps the first."""
        try:
            await self.backends.append(*prefix_group(digest, conversation_id, message_id, index))
        except RemoteError as exc:
            if exc.code != "version-conflict":
                raise

    async def longest_prefix(self, hashes: list[str], messages: list[dict[str, Any]],
                             conversation_id: str | None) -> tuple[int, dict[str, Any] | None]:
        """(k, record): the first k messages are stored (record names the last of them); (0, None) when none.
        Recorded prefixes are prefix-closed (every stored message's prefix is recorded), so after probing the
        likely ends — the whole request (a retry) and its last assistant message (the previous answer) — a
        binary search finds the rest in O(log n) reads."""
        n = len(hashes)
        if n == 0:
            return 0, None

        def ok(rec: dict[str, Any] | None) -> bool:
            return rec is not None and (conversation_id is None or rec["conversationId"] == conversation_id)

        last_answer = max((i + 1 for i, m in enumerate(messages) if m["role"] == "assistant"), default=0)
        probes = sorted({n, last_answer} - {0})
        found = dict(zip(probes, await asyncio.gather(*(self._prefix(hashes[k - 1]) for k in probes)),
                         strict=True))
        if ok(found[n]):
            return n, found[n]
        lo, hi, best = 0, n - 1, None
        if 0 < last_answer < n:
            if ok(found[last_answer]):
                lo, best = last_answer, found[last_answer]
            else:
                hi = last_answer - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            rec = await self._prefix(hashes[mid - 1])
            if ok(rec):
                lo, best = mid, rec
            else:
                hi = mid - 1
        return lo, best

    # ---------- a request
    def turn_settings(self, model: ModelEntry, stored: dict[str, Any] | None) -> dict[str, Any]:
        """The conversation's settings as this turn runs them: the model's window (the request picks the model),
        the summarizer of the model or the deployment, web tools as the deployment says."""
        cs = dict(stored or {})
        cs["contextWindow"] = model.context_window
        cs.setdefault("webTools", self.config.web_tools)
        cs.setdefault("mcpMode", self.config.mcp_mode)
        summarizer = model.summarizer or self.config.summarizer
        if summarizer and "summarizer" not in cs:
            cs["summarizer"] = summarizer
        return cs

    async def start(self, who: Principal, req: GatewayRequest) -> Started:
        """Admit and queue the request's turn. The new messages' prefix records go in the admission's commit; when
        a concurrent request recorded one of them first (nothing of this one was stored), the request is started
        again with the identity it looked up, its records written beside the turn (first writer wins)."""
        t0 = time.perf_counter()
        try:
            try:
                return await self._start(who, req, t0)
            except PrefixRace as race:
                if race.found is not None:
                    raise
                # taken for new without a lookup, but one of its prefixes is recorded (a retry, a resent first
                # message): looked up now, as if the lookup had come at the commit
                return await self._start(who, req, t0, guess_new=False)
        except PrefixRace as race:
            # the same identity as before the race (concurrent identical requests are not retries of each
            # other: each gets its own turn, as without records in the commit)
            log.info("gateway-prefix-race", model=req.model)
            return await self._start(who, req, t0, found=race.found)

    async def _start(self, who: Principal, req: GatewayRequest, t0: float,
                     found: tuple[dict[str, Any] | None, int, dict[str, Any] | None] | None = None,
                     guess_new: bool = True) -> Started:
        """``found``: the identity a first attempt looked up (stored settings, k, record); its prefix records then
        go beside the turn. ``guess_new``: a request that cannot continue a conversation by what it holds (no
        answer in it, no id) is taken for a new conversation without a lookup when its prefix records go in the
        admission's commit: they must not exist yet, so the commit itself checks what the lookup would have found
        (none recorded: new; any recorded: the commit stores nothing and ``PrefixRace(None)`` has it looked up)."""
        model = self.model(req.model, req.dialect)
        if not req.messages:
            raise DialectError(400, "invalid_request_error", "messages must hold at least one message", "messages")
        if (found := bad_text_at(req.messages, "messages")) is not None:
            raise DialectError(400, "invalid_request_error", f"{found}, which is not accepted", "messages")
        hashes = prefix_hashes(who.tenant, req)
        explicit = req.conversation_id
        if explicit is not None and (len(explicit) > 128 or not CONVERSATION_ID.fullmatch(explicit)):
            raise DialectError(400, "invalid_request_error", "the conversation id is not one this server hands out "
                               "(conv_…)", "metadata.conversation_id")
        stored_settings = None
        guessed = (guess_new and found is None and explicit is None
                   and not any(m["role"] == "assistant" for m in req.messages)
                   and not client_results(req.messages) and len(req.messages) + 3 <= BATCH_MAX_GROUPS)
        if found is not None:
            stored_settings, k, rec = found
        elif guessed:
            k, rec = 0, None
        elif explicit:  # the caller's tenant only: another tenant's conversation reads as a missing one (404)
            stored_settings, (k, rec) = await asyncio.gather(self.edge.conversation_settings(explicit, who),
                                                             self.longest_prefix(hashes, req.messages, explicit))
        else:
            k, rec = await self.longest_prefix(hashes, req.messages, explicit)
        conversation_id = rec["conversationId"] if rec else explicit
        anchor = rec["messageId"] if rec else None
        created = conversation_id is None
        if explicit and rec is None:
            # a conversation the gateway has no prefix of (made through the API): the messages continue it
            hist = await self.backends.history(explicit)
            anchor = hist["messages"][-1]["id"] if hist["messages"] else None
        cs = self.turn_settings(model, stored_settings)
        conversation_id = conversation_id or new_id("conv")
        new = req.messages[k:]
        turn_id = new_id("turn")
        stored: list[dict[str, Any]] = []
        parent = anchor
        for m in new:
            mid = new_id("msg")
            stored.append({"id": mid, "parentId": parent, "role": m["role"], "parts": storable_parts(m["parts"])})
            parent = mid
        task_id = parent  # the turn answers the last message (a retry of a stored request: its last message)
        if task_id is None:
            raise DialectError(400, "invalid_request_error", "nothing to answer", "messages")
        creation = new_event("ConversationCreated", {
            "conversationId": conversation_id, "tenantId": who.tenant, "settings": cs,
            "title": f"gateway: {req.model}"[:200]}) if created else None
        watch = TurnWatch(deltas=req.stream)  # before the turn is queued: its deltas and end cannot be missed
        await watch.subscribe(self.backends.rpc.broker.connection, turn_id)
        started = Started(req, conversation_id, turn_id, hashes[-1], watch, t0, created=created, who=who)
        provider: dict[str, Any] = {"kind": model.dialect, "model": model.upstream_model}
        if not req.stream:  # the client waits for one whole answer: the model is asked for one too
            provider["stream"] = False
        queued = self.edge.queued_event(conversation_id, turn_id, task_id, provider, cs, self.config.max_steps,
                                        extra=self.command_fields(req, model.dialect, hashes[-1]))
        lane = client_results(stored)
        # input that must be trimmed or stored by reference first is stored after a continuation's admission, so a
        # busy conversation (409) stores nothing; otherwise one commit holds it all
        early = not created and (lane or not all(inline(m) for m in stored))
        records = [(hashes[k + i], conversation_id, m["id"], k + i + 1) for i, m in enumerate(stored)]
        # the prefix records in the commit of the messages they name (a lane's messages are stored after it, and
        # an early admission commits apart from them: their records go beside the turn)
        in_commit = found is None and not lane and not early and len(records) + 3 <= BATCH_MAX_GROUPS
        # a conversation this commit created holds exactly these messages: the runner need not read them back
        window = stored if created and in_commit and all(inline(m) for m in stored) else None
        message = self.edge.queue.message(turn_id, conversation_id, queued["data"], window)
        handoff = None if lane else message  # the lane stores results after the commit: the submit waits for it
        admitted = sent = False
        try:
            ended_at = None if created else self.ended.pop(conversation_id, None)
            if early:
                started.admission = await self.edge.admit_for(who, conversation_id, turn_id, task_id,
                                                              ended_at=ended_at)
                admitted = True
            conversation = [creation] if creation else []
            if not lane:
                conversation += await self.input_events(conversation_id, stored)
            groups = [(f"turn:{turn_id}", [queued], 0)]
            if conversation:
                groups.insert(0, (f"conversation:{conversation_id}", conversation, 0 if creation else None))
            if in_commit:
                groups += [prefix_group(*r) for r in records]
            sent = True
            if admitted:
                await self.backends.append_streams(groups, enqueue=handoff)
            else:  # admission, creation, new messages, their prefixes and command: one commit, all or nothing
                try:
                    started.admission = await self.edge.admit_for(who, conversation_id, turn_id, task_id,
                                                                  fresh=created, ended_at=ended_at, alongside=groups,
                                                                  enqueue=handoff)
                except RemoteError as exc:
                    if in_commit and exc.code == "version-conflict" and str(
                            (exc.details or {}).get("streamId", "")).startswith(PREFIX_STREAM):
                        raise PrefixRace(None if guessed else (stored_settings, k, rec)) from exc
                    raise
                admitted = True
            if lane:
                await self.store_results(conversation_id, turn_id, stored, cs)
            if not in_commit:  # recorded beside the turn; awaited before the response ends
                started.records = asyncio.create_task(self._record_all(records))
            await self.edge.submit(turn_id, conversation_id, message=message)
        except BaseException as exc:
            await watch.close()
            # a recorded command must end (one terminal event), run or not; a refused commit stored nothing (a
            # 409, an invalid input, a prefix race), and neither did a 429 (HTTPException: before any write)
            if admitted or (sent and not isinstance(exc, (HTTPException, PrefixRace))
                            and not (isinstance(exc, ServiceError) and not exc.retryable)):
                await asyncio.shield(self.edge.abandon(turn_id, exc))
            raise
        return started

    @staticmethod
    def command_fields(req: GatewayRequest, upstream: str, chain: str) -> dict[str, Any]:
        out: dict[str, Any] = {"gatewayChain": chain}
        if req.tools:
            out["clientTools"] = [{"name": t.name, "description": t.description, "inputSchema": t.input_schema}
                                  for t in req.tools]
        if req.tool_choice:
            out["toolChoice"] = req.tool_choice
        if req.parallel_tool_calls is not None:
            out["parallelToolCalls"] = req.parallel_tool_calls
        if req.system:
            out["system"] = req.system
        if options := upstream_options(req.options, upstream):
            out["options"] = options
        if req.max_tokens:
            out["maxOutputTokens"] = req.max_tokens
        return out

    async def _record_all(self, rows: list[tuple[str, str, str, int]]) -> None:
        await asyncio.gather(*(self._record(*r) for r in rows))

    async def input_events(self, conversation_id: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The new messages without client tool results as events (large parts by reference, owned by the
        conversation, as the API stores a user message)."""
        small = await asyncio.gather(*(content_ref.store_message_parts(
            self.backends.blobs, m, conversation_id, ("conversation", conversation_id), "tool_output")
            for m in messages))
        return [new_event("UserMessageAdded", {"message": m}) for m in small]

    async def store_results(self, conversation_id: str, turn_id: str, messages: list[dict[str, Any]],
                            cs: dict[str, Any]) -> None:
        """New messages with client tool results: one persist-lane call (idempotent by the turn), the results
        trimmed in flight first, exactly as the runner trims its own tools' results."""
        results = [p for m in messages if m["role"] == "tool" for p in m["parts"] if p.get("type") == "tool-result"]
        settings = {"truncateThreshold": cs.get("truncateThreshold"), "contextWindow": cs.get("contextWindow"),
                    "reservation": cs.get("reservation")}
        try:
            trimmed = (await self.backends.truncate_step(conversation_id, turn_id, settings, results))["parts"]
        except RemoteError as exc:  # better fat than lost: the outputs are stored whole
            log.warning("gateway-truncation-unavailable", turn_id=turn_id, error=safe_text(exc))
            trimmed = results
        by_id = {p["toolCallId"]: p for p in trimmed}
        messages = [m if m["role"] != "tool" else
                    {**m, "parts": [by_id.get(p.get("toolCallId"), p) if p.get("type") == "tool-result" else p
                                    for p in m["parts"]]} for m in messages]
        # the input's own record id: the turn's messages (its answer) are the runner's; the turn's task must not
        # be taken for one of them (compaction finds a turn's task before the turn's first row)
        await self.backends.complete_turn(conversation_id, input_record(turn_id), messages, cs.get("truncateThreshold"),
                                          event_id=event_id(turn_id, "gateway-input"))

    # ---------- the response
    async def wait_end(self, started: Started, on_delta: Callable[[dict[str, Any]], None] | None = None
                       ) -> AsyncIterator[dict[str, Any]]:
        """The turn's live deltas until it ends (yielded as they come); after BACKSTOP_S of silence the turn's
        tail is read (a lost end notice) and, while it runs, ``{"ping": True}`` yielded (a stream's keep-alive
        while a long model call or a server-side tool runs)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.wait_s
        while True:
            try:
                kind, item = await asyncio.wait_for(started.watch.items.get(), BACKSTOP_S)
            except TimeoutError:
                _, latest = await self.edge.stream_tail(f"turn:{started.turn_id}")
                if latest is not None and latest["type"] in TERMINAL:
                    return
                if loop.time() > deadline:
                    raise ServiceError(f"turn {started.turn_id} did not end within {self.config.wait_s:.0f} s",
                                       code="timeout", retryable=True) from None
                yield {"ping": True}
                continue
            if kind == "ended":
                started.notice = item
                return
            yield item

    async def finish(self, started: Started) -> Finished:
        """The ended turn's result from its events; the answer's prefix recorded before the client sees it."""
        await started.watch.close()
        self.edge.turn_ended(started.turn_id)  # its next admission reads nothing about it
        if started.who is not None:  # ended: no longer counts against the key's running turns
            self.edge.auth.turn_not_started(started.who, started.turn_id)
        self.turn_ended(started)
        if started.records is not None:
            await started.records
        summary = (started.notice or {}).get("result")
        if summary is not None:  # the runner recorded the answer's prefix before it ended the turn
            result = GatewayResult(text=summary["text"], tool_calls=summary["toolCalls"],
                                   stop_reason=summary["stopReason"], usage=summary["usage"])
            return Finished(result, None, summary["servedTokens"], summary["modelMs"])
        events = await self.backends.read_stream_all(f"turn:{started.turn_id}")
        st = fold(started.turn_id, events)
        await content.resolve_steps(self.backends.blobs, st)
        served = [e["data"] for e in events if e["type"] == "StepServed"]
        served_tokens = sum(int(d.get("servedTokens") or 0) for d in served)
        upstream_ms = sum(float(d.get("modelMs") or 0) for d in served)
        term = st.terminal or {"type": "TurnFailed", "data": {"code": "unended", "message": "the turn has not ended"}}
        if term["type"] != "TurnCompleted":
            d = term["data"]
            error = {"status": turn_failure_status(d.get("code"), d.get("retryable")),
                     "message": f"{d.get('code')}: {d.get('message')}"[:2000], "code": d.get("code")}
            return Finished(None, error, served_tokens, upstream_ms)
        result = gateway_result(st, set(term["data"].get("pendingToolCalls") or []))
        ids = term["data"].get("messageIds") or []
        if ids:
            await self._record(chain_hash(started.chain, result_message(result)), started.conversation_id, ids[-1],
                               len(started.request.messages) + 1)
        return Finished(result, None, served_tokens, upstream_ms)

    def turn_ended(self, started: Started) -> None:
        if started.admission:
            self.ended[started.conversation_id] = started.admission
            self.ended.move_to_end(started.conversation_id)
            while len(self.ended) > ENDED_KEPT:
                self.ended.popitem(last=False)

    def headers(self, started: Started, finished: Finished | None = None) -> dict[str, str]:
        h = {"X-Ctx-Conversation-Id": started.conversation_id, "X-Ctx-Turn-Id": started.turn_id}
        if finished is not None:
            h["X-Ctx-Served-Tokens"] = str(finished.served_tokens)
            h["X-Ctx-Overhead-Ms"] = f"{overhead_ms(started, finished):.1f}"
        return h

    def abort_later(self, who: Principal, started: Started, reason: str) -> None:
        """The client went away mid-turn: the turn is aborted (the conversation's turn lock is freed)."""
        async def run() -> None:
            try:
                await self.edge.abort(who, started.conversation_id, started.turn_id, reason)
            except ServiceError:
                pass  # already ended
            except Exception as exc:  # noqa: BLE001 - the abort backstop of the turn is the runner's step limit
                log.warning("gateway-abort-failed", turn_id=started.turn_id, error=safe_text(exc))
        task = asyncio.create_task(run(), name=f"gateway-abort:{started.turn_id}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


class PrefixRace(Exception):
    """A concurrent request recorded one of this request's new prefixes between the lookup and the commit; the
    commit stored nothing. ``found``: the lookup's result (stored settings, k, record); None when the request was
    taken for new without a lookup."""

    def __init__(self, found: tuple[dict[str, Any] | None, int, dict[str, Any] | None] | None) -> None:
        super().__init__("a concurrent request recorded one of this request's prefixes first")
        self.found = found


def client_results(messages: list[dict[str, Any]]) -> bool:
    """Whether messages hold client tool results (stored through the persist lane, after the admission)."""
    return any(p.get("type") == "tool-result" for m in messages if m["role"] == "tool" for p in m["parts"])


def prefix_group(digest: str, conversation_id: str, message_id: str, index: int
                 ) -> tuple[str, list[dict[str, Any]], int]:
    """The append of one prefix record: a stream of its own that must not exist yet (first writer wins)."""
    return (PREFIX_STREAM + digest, [new_event("GatewayPrefixRecorded", {
        "conversationId": conversation_id, "messageId": message_id, "index": index})], 0)


def inline(message: dict[str, Any]) -> bool:
    """Are the message's parts small enough to stay in their event (nothing to store by reference first)?"""
    return len(content_ref.encode(message["parts"])) <= content_ref.INLINE_MAX_BYTES


def storable_parts(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A client's parts as a stored message holds them: a tool call's arguments that were not a JSON object (an
    OpenAI client may send any string) are kept whole as ``{"arguments": <the text>}`` — the message's identity
    is the chain of what the client sent, so the next resend still matches."""
    return [{**p, "input": {"arguments": p["input"]}} if p.get("type") == "tool-call"
            and not isinstance(p.get("input"), dict) else p for p in parts]


# sampling options each upstream takes (the rest of a client's fields are not sent: they would be refused, or
# change what the gateway must answer — n, logprobs, thinking)
OPENAI_OPTIONS = frozenset({"temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty",
                            "logit_bias", "user", "response_format", "reasoning_effort", "service_tier"})
ANTHROPIC_OPTIONS = frozenset({"temperature", "top_p", "top_k", "stop_sequences"})


def upstream_options(options: dict[str, Any], upstream: str) -> dict[str, Any]:
    """A client's sampling options in the upstream dialect's terms (stop ⇄ stop_sequences)."""
    opts = dict(options)
    if upstream == "anthropic" and "stop" in opts and "stop_sequences" not in opts:
        stop = opts.pop("stop")
        if stop is not None:
            opts["stop_sequences"] = [stop] if isinstance(stop, str) else stop
    if upstream == "openai" and "stop_sequences" in opts and "stop" not in opts:
        opts["stop"] = opts.pop("stop_sequences")
    allowed = ANTHROPIC_OPTIONS if upstream == "anthropic" else OPENAI_OPTIONS
    return {k: v for k, v in opts.items() if k in allowed and v is not None}


def overhead_ms(started: Started, finished: Finished) -> float:
    """ctxbuild's own time in the request: the wall time so far less the upstream model's time."""
    return max((time.perf_counter() - started.t0) * 1000 - finished.upstream_ms, 0.0)
