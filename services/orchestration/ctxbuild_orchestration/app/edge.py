"""The edge's use cases: what the HTTP routes do against the backends and the work queue (conversations,
attachments, admission of turns, aborts, reading turns back, API keys). The routers (routers/) only parse, call
these and encode."""

from __future__ import annotations

import asyncio
import hmac
import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import structlog
from ctxbuild_blobclient import content_ref
from ctxbuild_codec.models.subjects.ctx_turn_abort_request import TurnAbortNotice
from ctxbuild_platform.errors import RemoteError, ServiceError
from ctxbuild_platform.text import first_bad_text
from opentelemetry.propagate import inject
from pydantic import BaseModel

from ..adapters import content
from ..adapters.aborts import publish_abort
from ..adapters.auth import Authenticator
from ..adapters.backends import Backends, new_event
from ..adapters.deltas import TurnFeed
from ..adapters.work_queue import TurnMessage, TurnQueue
from ..domain.keys import KEY_INDEX, KEY_STREAM, LEGACY_TENANT, Principal, new_key
from ..domain.turn_state import TERMINAL, TurnState, event_id, fold
from .results import full_output
from .runner import keep_finished_steps, new_id

log = structlog.get_logger("edge")

REPLAY_INLINE_MAX_BYTES = 32 * 1024  # a larger replay script goes to the blob store with the turn (events stay small)
# one running turn per conversation: the admissions stream (event TurnAdmitted, appended with expected version)
ADMISSIONS_PREFIX = "conversation-turns:"
# an admitted turn with no event yet after this long was abandoned by a crashed edge: it no longer holds the lock
ADMISSION_GRACE_S = 60.0
# an abort of a running turn: the runner holding it ends it at once (wake-up) or at its next write; a turn whose
# runner is gone is ended by the edge after this long (the same terminal event id: still exactly one)
ABORT_GRACE_S = 10.0
ENDED_TURNS_KEPT = 10_000  # turns this replica saw end (their end notice): admission reads nothing about them


@dataclass(frozen=True)
class EdgeLimits:
    """Input limits of the HTTP edge (Settings ``max_*``): over one → 413 naming the limit."""

    body_bytes: int = 64 * 1024 * 1024
    attachment_bytes: int = 4 * 1024 * 1024 * 1024
    title_chars: int = 1000
    turn_text_bytes: int = 8 * 1024 * 1024
    replay_script_bytes: int = 48 * 1024 * 1024
    attachment_name_chars: int = 255

    @classmethod
    def from_settings(cls, settings: Any) -> EdgeLimits:
        return cls(body_bytes=settings.max_body_bytes, attachment_bytes=settings.max_attachment_bytes,
                   title_chars=settings.max_title_chars, turn_text_bytes=settings.max_turn_text_bytes,
                   replay_script_bytes=settings.max_replay_script_bytes,
                   attachment_name_chars=settings.max_attachment_name_chars)


def bad_text_at(value: Any, where: str) -> str | None:
    """Where the first NUL character or lone surrogate is in a JSON value (keys included), or None. Neither can
    be stored and read back as text (Postgres text refuses NUL, UTF-8 has no surrogates)."""
    found = first_bad_text(value, where)
    if found is None:
        return None
    if found.in_key:
        return f"a key of {found.path} holds a NUL character or a lone surrogate"
    return f"{found.path} holds {found.describe()} at index {found.index}"


def safe_text(text: Any) -> str:
    """Text for an error message: a NUL or a lone surrogate from the input must not break the reply itself."""
    return str(text).replace("\x00", "\\u0000").encode("utf-8", "backslashreplace").decode("utf-8")[:300]


def terminal_failure(turn_id: str, data: dict[str, Any]) -> dict[str, Any]:
    """A TurnFailed with the turn's one terminal event id (as the runner's): written twice, stored once."""
    return {"eventId": event_id(turn_id, "terminal"), "type": "TurnFailed", "data": data}


def aborted(turn_id: str, reason: str, how: str) -> dict[str, Any]:
    return terminal_failure(turn_id, {"turnId": turn_id, "code": "aborted", "retryable": False,
                                      "message": f"the turn was aborted ({how}): {reason}"})


def too_large(what: str, size: int, limit: int, unit: str, setting: str) -> ServiceError:
    return ServiceError(f"{what} is {size:,} {unit}; this server accepts at most {limit:,} (CTX_{setting})",
                        code="too-large", details={"size": size, "limit": limit})


def conversation_not_found(conversation_id: str) -> ServiceError:
    """The one answer for a conversation that does not exist and for another tenant's (no oracle)."""
    return ServiceError(f"conversation {conversation_id} not found", code="not-found")


def turn_not_found(conversation_id: str, turn_id: str) -> ServiceError:
    return ServiceError(f"turn {turn_id} not found in conversation {conversation_id}", code="not-found")


def turn_in_progress(conversation_id: str, turn_id: str | None) -> ServiceError:
    which = f" ({turn_id})" if turn_id else ""
    return ServiceError(f"conversation {conversation_id} has a turn in progress{which}: one turn runs per "
                        "conversation at a time; wait for it to end (…/turns/{turnId}/events) or abort it",
                        code="turn-in-progress", details={"turnId": turn_id} if turn_id else None)


def turn_status(st: TurnState) -> str:
    return ("completed" if st.terminal and st.terminal["type"] == "TurnCompleted" else
            "failed" if st.terminal else "running" if st.started else "queued")


class Edge:
    """The use cases behind the HTTP API (one per edge process)."""

    def __init__(self, backends: Backends, queue: TurnQueue, check_provider: Callable[[dict[str, Any]], None],
                 max_steps_limit: int, limits: EdgeLimits, auth: Authenticator,
                 abort_grace_s: float = ABORT_GRACE_S, admission_grace_s: float = ADMISSION_GRACE_S) -> None:
        self.backends, self.queue, self.auth, self.limits = backends, queue, auth, limits
        self.check_provider = check_provider
        self.max_steps_limit = max_steps_limit
        self.abort_grace_s = abort_grace_s
        self.admission_grace_s = admission_grace_s
        self.watchdogs: set[asyncio.Task] = set()  # held: an unreferenced task may be collected before it runs
        # a hint, never the record: a turn in it has ended for sure (a terminal event is final); a miss reads
        self.ended_turns: OrderedDict[str, None] = OrderedDict()

    def turn_ended(self, turn_id: str) -> None:
        """This replica saw ``turn_id``'s terminal event stored (its end notice, or the event itself)."""
        self.ended_turns[turn_id] = None
        self.ended_turns.move_to_end(turn_id)
        while len(self.ended_turns) > ENDED_TURNS_KEPT:
            self.ended_turns.popitem(last=False)

    # ---------- ownership and reads
    async def conversation_settings(self, conversation_id: str, who: Principal) -> dict[str, Any]:
        """The conversation's settings, if it exists and belongs to the caller's tenant (else the same 404)."""
        first = await self.backends.read_stream(f"conversation:{conversation_id}", 1, limit=1)
        if not first["events"] or first["events"][0]["type"] != "ConversationCreated":
            raise conversation_not_found(conversation_id)
        data = first["events"][0]["data"]
        if not hmac.compare_digest(str(data.get("tenantId", LEGACY_TENANT)).encode(), who.tenant.encode()):
            raise conversation_not_found(conversation_id)
        return data.get("settings", {})

    async def turn_state(self, conversation_id: str, turn_id: str,
                         who: Principal) -> tuple[TurnState, list[dict[str, Any]]]:
        await self.conversation_settings(conversation_id, who)
        return await self.turn_of(conversation_id, turn_id)

    async def turn_of(self, conversation_id: str, turn_id: str) -> tuple[TurnState, list[dict[str, Any]]]:
        """A turn of a conversation whose ownership the caller has checked."""
        events = await self.backends.read_stream_all(f"turn:{turn_id}")
        st = fold(turn_id, events)
        if st.command is None or st.command.get("conversationId") != conversation_id:
            raise turn_not_found(conversation_id, turn_id)
        return st, events

    async def stream_tail(self, stream: str) -> tuple[int, dict[str, Any] | None]:
        """A stream's version and its last event: one read, whatever the stream's length."""
        page = await self.backends.stream_last(stream)
        return page["lastVersion"], (page["events"][0] if page["events"] else None)

    # ---------- conversations
    async def create_conversation(self, who: Principal, title: str | None,
                                  settings: dict[str, Any]) -> dict[str, Any]:
        if title and len(title) > self.limits.title_chars:
            raise too_large("the title", len(title), self.limits.title_chars, "characters", "MAX_TITLE_CHARS")
        cid = new_id("conv")
        data = {"conversationId": cid, "tenantId": who.tenant, "settings": settings}
        if title:
            data["title"] = title
        await self.backends.append(f"conversation:{cid}", [new_event("ConversationCreated", data)], expected=0)
        return {"id": cid, "settings": data["settings"]}

    async def attach(self, who: Principal, conversation_id: str, name: str, media: str,
                     read: Callable[[int], Awaitable[bytes]]) -> dict[str, Any]:
        if (found := bad_text_at(name, "the file name")) is not None:
            raise ServiceError(f"{found}, which is not accepted", code="invalid-payload")
        if len(name) > self.limits.attachment_name_chars:
            raise too_large("the file name", len(name), self.limits.attachment_name_chars, "characters",
                            "MAX_ATTACHMENT_NAME_CHARS")
        if len(media) > 255 or bad_text_at(media, "the media type") is not None:
            raise ServiceError("the part's Content-Type is not a media type", code="invalid-payload")
        await self.conversation_settings(conversation_id, who)

        async def pieces():
            # streamed to the blob store in chunks: an attachment of any size in bounded memory
            while piece := await read(256 * 1024):
                yield piece

        stored = await self.backends.attach(conversation_id, name, pieces(), media)
        attachment = {k: stored[k] for k in ("sha256", "handle", "displayName", "mediaType", "size", "uri")}
        await self.backends.append(f"conversation:{conversation_id}",
                                   [new_event("AttachmentAdded", {"attachment": attachment})])
        return attachment

    async def messages(self, who: Principal, conversation_id: str, anchor: str | None,
                       branches: bool) -> dict[str, Any]:
        await self.conversation_settings(conversation_id, who)
        return await self.backends.history_all(conversation_id, anchor, branches)

    async def tool_result(self, who: Principal, conversation_id: str, message_id: str,
                          tool_call_id: str) -> dict[str, Any]:
        await self.conversation_settings(conversation_id, who)
        # the path to the message (any branch) ends with the message itself
        hist = await self.backends.rpc.call("ctx.persist.history", {"conversationId": conversation_id,
                                                                    "anchorId": message_id})
        msg = hist["messages"][-1] if hist["messages"] else None
        part = next((p for p in (msg or {}).get("parts", []) if p.get("type") == "tool-result"
                     and p.get("toolCallId") == tool_call_id), None)
        if part is None:
            raise ServiceError(f"no tool result {tool_call_id} in message {message_id}", code="not-found")
        return await full_output(self.backends, conversation_id, part)

    # ---------- turns: admission and queueing
    def checked_provider(self, spec: BaseModel) -> tuple[dict[str, Any], bytes | None]:
        """The provider spec as data (and a replay script's JSON), refused early: not configured, over the limit."""
        data = spec.model_dump(exclude_none=True)
        self.check_provider(data)
        if data["kind"] != "replay":
            return data, None
        raw = json.dumps({"script": data["script"], "tools": data.get("tools", [])}, ensure_ascii=False).encode()
        if (size := len(raw)) > self.limits.replay_script_bytes:
            raise too_large("the replay script", size, self.limits.replay_script_bytes, "bytes of JSON",
                            "MAX_REPLAY_SCRIPT_BYTES")
        return data, raw

    async def provider_payload(self, conversation_id: str, turn_id: str,
                               checked: tuple[dict[str, Any], bytes | None]) -> dict[str, Any]:
        """The provider as the turn command records it: never a secret; a large replay script by reference."""
        data, raw = checked
        if raw is not None and len(raw) > REPLAY_INLINE_MAX_BYTES:
            stored = await self.backends.blobs.put(raw, conversation_id, content.turn_owner(turn_id), content.KEPT,
                                                   media_type="application/json")
            return {"kind": "replay", "scriptRef": {"sha256": stored["sha256"], "size": stored["size"]}}
        return data

    def check_max_steps(self, max_steps: int | None) -> None:
        if max_steps is not None and max_steps > self.max_steps_limit:
            raise ServiceError(f"maxSteps {max_steps} is above this server's limit {self.max_steps_limit}",
                               code="invalid-payload")

    @staticmethod
    def queued_event(conversation_id: str, turn_id: str, user_message_id: str, provider: dict[str, Any],
                     settings: dict[str, Any], max_steps: int | None, regenerate_of: str | None = None,
                     extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """The turn's command (TurnQueued, version 1 of ``turn:<id>``). ``extra``: more fields (the gateway's
        client tools, system prompt, options)."""
        carrier: dict[str, str] = {}
        inject(carrier)  # the turn continues this request's trace on whichever replica runs it
        cmd = {"turnId": turn_id, "conversationId": conversation_id, "userMessageId": user_message_id,
               "provider": provider, "settings": settings, "trace": carrier, **(extra or {})}
        if max_steps is not None:
            cmd["maxSteps"] = max_steps
        if regenerate_of:
            cmd["regenerateOf"] = regenerate_of
        return new_event("TurnQueued", cmd)

    async def enqueue(self, conversation_id: str, turn_id: str, user_message_id: str, provider: dict[str, Any],
                      settings: dict[str, Any], max_steps: int | None, regenerate_of: str | None = None,
                      extra: dict[str, Any] | None = None, alongside: Awaitable[Any] | None = None,
                      streams: Sequence[tuple[str, list[dict[str, Any]], int | None]] = ()) -> None:
        """Record the command, then submit it: persistence publishes it right after the commit (the work-queue
        message goes with the append), the edge only when that did not happen. ``streams``: appends ``(stream,
        events, expected version)`` stored in the command's commit (all or nothing). ``alongside``: work the runner
        needs done before the command is submitted, not before it is recorded: run beside the TurnQueued append
        (the edge submits after both); a failure of either submits nothing."""
        cmd = self.queued_event(conversation_id, turn_id, user_message_id, provider, settings, max_steps,
                                regenerate_of, extra)
        message = self.queue.message(turn_id, conversation_id, cmd["data"])
        groups = [*streams, (f"turn:{turn_id}", [cmd], 0)]
        if alongside is None:
            await self.backends.append_streams(groups, enqueue=message)
        else:
            for outcome in await asyncio.gather(self.backends.append_streams(groups), alongside,
                                                return_exceptions=True):
                if isinstance(outcome, BaseException):
                    raise outcome
        await self.submit(turn_id, conversation_id, message=message)

    async def submit(self, turn_id: str, conversation_id: str, command: dict[str, Any] | None = None,
                     window: list[dict[str, Any]] | None = None, message: TurnMessage | None = None) -> None:
        """The recorded command to the work queue (``command``: its TurnQueued data, riding along so the runner need
        not read it back; ``window``: the messages of the conversation that commit created, likewise; ``message``:
        the one built already — nothing to do when persistence enqueued it with the commit); a refusal ends the
        turn (its admission no longer holds the conversation)."""
        message = message or self.queue.message(turn_id, conversation_id, command, window)
        if message.enqueued:
            return
        try:
            await self.queue.publish(message)
        except Exception as exc:
            await self.backends.append(f"turn:{turn_id}", [terminal_failure(turn_id, {
                "turnId": turn_id, "code": "unavailable", "message": "the work queue refused the turn",
                "retryable": True})])
            raise ServiceError(f"the work queue is unavailable: {exc}", code="unavailable", retryable=True) from exc

    def _older_than_grace(self, event: Mapping[str, Any]) -> bool:
        at = datetime.fromisoformat(event["recordedAt"])
        return (datetime.now(UTC) - at).total_seconds() >= self.admission_grace_s

    async def still_running(self, admitted: Mapping[str, Any]) -> bool:
        """Has the turn of an admission not ended yet? (No event yet: being queued right now, unless abandoned.)
        A turn this replica saw end is not read. A turn left at its command is submitted again
        (:meth:`resubmit_if_stranded`): it holds the conversation until it has run."""
        turn_id = admitted["data"]["turnId"]
        if turn_id in self.ended_turns:
            return False
        _, latest = await self.stream_tail(f"turn:{turn_id}")
        if latest is None:
            return not self._older_than_grace(admitted)
        await self.resubmit_if_stranded(turn_id, latest)
        return latest["type"] not in TERMINAL

    async def resubmit_if_stranded(self, turn_id: str, latest: Mapping[str, Any]) -> None:
        """A turn whose only event is its command (TurnQueued, version 1), recorded longer than the admission grace
        ago, may never have reached the work queue: the edge that recorded it died, or lost its connection, between
        the commit and the submit. Submit it again. Harmless when it did arrive: the queue drops a duplicate within
        its window, and a runner runs a turn once (TurnStarted's expected version; a started or ended turn is
        acknowledged and left)."""
        if latest["type"] != "TurnQueued" or latest["version"] != 1 or not self._older_than_grace(latest):
            return
        data = latest["data"]
        conversation_id = data["conversationId"]
        try:
            await self.queue.submit(turn_id, conversation_id, data)
            log.warning("stranded-turn-resubmitted", turn_id=turn_id, conversation_id=conversation_id,
                        recorded_at=latest["recordedAt"])
        except Exception as exc:  # noqa: BLE001 - the next request for the conversation tries again
            log.warning("stranded-turn-not-resubmitted", turn_id=turn_id, error=safe_text(exc))

    async def admit(self, conversation_id: str, turn_id: str, user_message_id: str,
                    regenerate_of: str | None = None, fresh: bool = False, ended_at: int | None = None,
                    alongside: Sequence[tuple[str, list[dict[str, Any]], int | None]] = (),
                    enqueue: TurnMessage | None = None) -> int:
        """One running turn per conversation (SPEC §15.3), race-free: the previous admission's turn must have
        ended, and the new admission is appended with the admissions stream's expected version — of concurrent
        requests exactly one is admitted, the others get 409. ``fresh``: a conversation this request has just
        created has no admission yet (nothing to read; expected version 0 still guards it). ``ended_at``: the
        version of an admission whose turn the caller saw end — appended after it without reading; anything
        admitted since makes that append conflict, and the stream is then read as usual. ``alongside``: appends
        ``(stream, events, expected version)`` stored in the admission's commit (``ctx.persist.append_batch``): a
        refused admission stores none of them, an admitted one all; ``enqueue``: the work-queue message of the
        command among them, published by persistence after that commit (``enqueue.enqueued``). Returns the version
        of the new admission."""
        stream = ADMISSIONS_PREFIX + conversation_id
        data = {"turnId": turn_id, "userMessageId": user_message_id}
        if regenerate_of:
            data["regenerateOf"] = regenerate_of

        async def write(expected: int) -> None:
            admission = [new_event("TurnAdmitted", data)]
            if alongside:
                await self.backends.append_streams([(stream, admission, expected), *alongside], enqueue=enqueue)
            else:
                await self.backends.append(stream, admission, expected=expected)

        def lost(exc: RemoteError) -> bool:  # the admission's own version moved (not another group's)
            return exc.code == "version-conflict" and (exc.details or {}).get("streamId", stream) == stream

        if ended_at is not None:
            try:
                await write(ended_at)
                return ended_at + 1
            except RemoteError as exc:
                if not lost(exc):
                    raise
        version, previous = (0, None) if fresh else await self.stream_tail(stream)
        if previous is not None and await self.still_running(previous):
            raise turn_in_progress(conversation_id, previous["data"]["turnId"])
        try:
            await write(version)
        except RemoteError as exc:
            if lost(exc):  # another request was admitted between our read and our append
                raise turn_in_progress(conversation_id, None) from exc
            raise
        return version + 1

    async def admit_for(self, who: Principal, conversation_id: str, turn_id: str, user_message_id: str,
                        regenerate_of: str | None = None, fresh: bool = False, ended_at: int | None = None,
                        alongside: Sequence[tuple[str, list[dict[str, Any]], int | None]] = (),
                        enqueue: TurnMessage | None = None) -> int:
        """The caller's running-turn limit (429), then the conversation's one running turn (409); the new
        admission's version (``alongside``, ``enqueue``: see :meth:`admit`)."""
        async def running(t: str) -> bool:
            if t in self.ended_turns:
                return False
            _, latest = await self.stream_tail(f"turn:{t}")
            if latest is None:
                return True
            await self.resubmit_if_stranded(t, latest)
            return latest["type"] not in TERMINAL

        await self.auth.admit_turn(who, turn_id, running)
        try:
            return await self.admit(conversation_id, turn_id, user_message_id, regenerate_of, fresh, ended_at,
                                    alongside, enqueue)
        except BaseException:
            self.auth.turn_not_started(who, turn_id)
            raise

    async def abandon(self, turn_id: str, exc: BaseException) -> None:
        """An admitted turn that could not be queued ends at once (its admission no longer holds the lock)."""
        try:
            await self.backends.append(f"turn:{turn_id}", [terminal_failure(turn_id, {
                "turnId": turn_id, "code": "not-queued", "retryable": True,
                "message": f"the turn was admitted but could not be queued: {type(exc).__name__}"})])
        except Exception as err:  # noqa: BLE001 - the admission's grace period frees the conversation instead
            log.warning("turn-not-abandoned", turn_id=turn_id, error=safe_text(err))

    @staticmethod
    def accepted(conversation_id: str, turn_id: str, user_message_id: str) -> dict[str, Any]:
        return {"turnId": turn_id, "userMessageId": user_message_id,
                "events": f"/v1/conversations/{conversation_id}/turns/{turn_id}/events"}

    async def create_turn(self, who: Principal, conversation_id: str, text: str, provider_spec: BaseModel,
                          max_steps: int | None) -> dict[str, Any]:
        if (size := len(text.encode())) > self.limits.turn_text_bytes:
            raise too_large("the turn text", size, self.limits.turn_text_bytes, "bytes", "MAX_TURN_TEXT_BYTES")
        self.check_max_steps(max_steps)
        cs = await self.conversation_settings(conversation_id, who)
        checked = self.checked_provider(provider_spec)
        turn_id, msg_id = new_id("turn"), new_id("msg")
        await self.admit_for(who, conversation_id, turn_id, msg_id)
        try:
            provider = await self.provider_payload(conversation_id, turn_id, checked)
            hist = await self.backends.history(conversation_id)
            parent = hist["messages"][-1]["id"] if hist["messages"] else None
            message = {"id": msg_id, "parentId": parent, "role": "user", "parts": [{"type": "text", "text": text}]}
            # large parts by reference (the event stays small), owned by the conversation: never collected
            message = await content_ref.store_message_parts(self.backends.blobs, message, conversation_id,
                                                            ("conversation", conversation_id), "tool_output")
            # the message and the command: one commit
            await self.enqueue(conversation_id, turn_id, msg_id, provider, cs, max_steps, streams=[(
                f"conversation:{conversation_id}", [new_event("UserMessageAdded", {"message": message})], None)])
        except BaseException as exc:
            await asyncio.shield(self.abandon(turn_id, exc))
            raise
        return self.accepted(conversation_id, turn_id, msg_id)

    async def regenerate(self, who: Principal, conversation_id: str, turn_id: str, provider_spec: BaseModel | None,
                         max_steps: int | None) -> dict[str, Any]:
        cs = await self.conversation_settings(conversation_id, who)
        st, _ = await self.turn_of(conversation_id, turn_id)
        checked = self.checked_provider(provider_spec) if provider_spec else None
        new_turn = new_id("turn")
        cmd = st.command or {}
        max_steps = max_steps if max_steps is not None else cmd.get("maxSteps")
        self.check_max_steps(max_steps)
        await self.admit_for(who, conversation_id, new_turn, cmd["userMessageId"], regenerate_of=turn_id)
        try:
            provider = (await self.provider_payload(conversation_id, new_turn, checked) if checked
                        else cmd["provider"])
            await self.enqueue(conversation_id, new_turn, cmd["userMessageId"], provider, cs, max_steps,
                               regenerate_of=turn_id)
        except BaseException as exc:
            await asyncio.shield(self.abandon(new_turn, exc))
            raise
        return {**self.accepted(conversation_id, new_turn, cmd["userMessageId"]), "regenerateOf": turn_id}

    # ---------- turns: aborts
    async def admitted_last(self, conversation_id: str, turn_id: str) -> bool:
        """Is ``turn_id`` the conversation's latest admission (the one that holds its turn lock)?"""
        _, latest = await self.stream_tail(ADMISSIONS_PREFIX + conversation_id)
        return latest is not None and latest["data"].get("turnId") == turn_id

    async def end_if_unended(self, turn_id: str, reason: str) -> None:
        """The backstop of an abort: after the grace, a turn still without a terminal event (its runner died, or
        its command was lost) is ended here."""
        await asyncio.sleep(self.abort_grace_s)
        try:
            _, latest = await self.stream_tail(f"turn:{turn_id}")
            if latest is None or latest["type"] not in TERMINAL:
                st = fold(turn_id, await self.backends.read_stream_all(f"turn:{turn_id}"))
                await keep_finished_steps(self.backends, st, "aborted")  # as the runner would have (SPEC §15.4)
                await self.backends.append(f"turn:{turn_id}", [aborted(turn_id, reason, "no runner ended it")])
                log.warning("abort-ended-by-edge", turn_id=turn_id)
        except Exception as exc:  # noqa: BLE001 - the redelivered command reads TurnAbortRequested and ends it
            log.warning("abort-backstop-failed", turn_id=turn_id, error=safe_text(exc))

    async def abort(self, who: Principal, conversation_id: str, turn_id: str, reason: str) -> dict[str, Any]:
        """Any turn that has not ended can be aborted, and always ends with exactly one terminal event (SPEC
        §15.4), freeing the conversation's turn lock. Durable first (TurnAbortRequested, read by the runner at
        pick-up and when its next write finds it), then a wake-up for the replica running it. A turn no runner
        has started (queued, its command maybe lost) is ended here at once; an admitted turn that was never
        queued too; a started one is ended here after a grace if no runner did it."""
        await self.conversation_settings(conversation_id, who)
        stream = f"turn:{turn_id}"
        st = fold(turn_id, await self.backends.read_stream_all(stream))
        if st.command is None or st.command.get("conversationId") != conversation_id:
            if st.command is None and await self.admitted_last(conversation_id, turn_id):
                if st.done:
                    raise ServiceError(f"turn {turn_id} already ended ({st.terminal['type']})", code="conflict")
                # admitted, never queued (the edge failed in between): holds the lock until it ends
                await self.backends.append(stream, [aborted(turn_id, reason, "admitted, never queued")])
                return {"turnId": turn_id, "status": "aborted"}
            raise turn_not_found(conversation_id, turn_id)
        if st.done:
            raise ServiceError(f"turn {turn_id} already ended ({st.terminal['type']})", code="conflict")
        await self.backends.append(stream, [new_event("TurnAbortRequested", {"turnId": turn_id, "reason": reason})])
        if not st.started:  # no runner holds it: a runner picking it up now finds the end (or the abort)
            await self.backends.append(stream, [aborted(turn_id, reason, "before it started")])
            return {"turnId": turn_id, "status": "aborted"}
        await publish_abort(self.backends.rpc.broker, TurnAbortNotice(turnId=turn_id, reason=reason))
        task = asyncio.create_task(self.end_if_unended(turn_id, reason), name=f"abort:{turn_id}")
        self.watchdogs.add(task)
        task.add_done_callback(self.watchdogs.discard)
        return {"turnId": turn_id, "status": "abort-requested"}

    # ---------- turns: reading them back
    async def event_stream(self, conversation_id: str, turn_id: str, st: TurnState, start: int, deltas: bool,
                           poll_s: float, disconnected: Callable[[], Awaitable[bool]]
                           ) -> AsyncIterator[dict[str, str]]:
        """The turn's events from version ``start`` as SSE items, ending with the terminal one; between reads the
        live text deltas (no ``id``: never replayed). The stream reads when an append to the turn is announced
        (``ctx.turn.appended``/``ended``) and otherwise every ``poll_s`` — the backstop for a lost notice."""
        nxt = start
        feed = TurnFeed(deltas=deltas)
        if not st.done:
            await feed.subscribe(self.backends.rpc.broker.connection, turn_id)
        loop = asyncio.get_running_loop()
        try:
            while not await disconnected():
                feed.stored.clear()  # an append announced from here on triggers the next read
                page = await self.backends.read_stream(f"turn:{turn_id}", nxt)
                # deltas that arrived while the page was read go first: a step's text is published before its
                # StepServed is appended, so the client sees the text live, then the record
                while page["events"] and not feed.live.empty():
                    yield {"event": "TextDelta", "data": feed.live.get_nowait().decode()}
                for ev in page["events"]:
                    nxt = ev["version"] + 1
                    ev = await content.present_event(self.backends.blobs, ev, conversation_id)
                    yield {"event": ev["type"], "id": str(ev["version"]), "data": json.dumps(ev["data"])}
                    if ev["type"] in TERMINAL:
                        return
                if page.get("more"):
                    continue  # more is stored already: no wait
                deadline = loop.time() + poll_s
                while (left := deadline - loop.time()) > 0:
                    data = await feed.next_delta(left)
                    if data is None:
                        break
                    yield {"event": "TextDelta", "data": data.decode()}
        finally:
            await feed.close()

    async def turn_log(self, who: Principal, conversation_id: str, turn_id: str) -> dict[str, Any]:
        st, events = await self.turn_state(conversation_id, turn_id, who)
        events = await content.present_events(self.backends.blobs, events, conversation_id)
        out: dict[str, Any] = {"turnId": turn_id, "status": turn_status(st), "steps": len(st.steps),
                               "events": events}
        if st.terminal and st.terminal["type"] == "TurnFailed":
            out["error"] = {k: st.terminal["data"].get(k) for k in ("code", "message", "retryable")}
        return out

    async def served_request(self, who: Principal, conversation_id: str, turn_id: str,
                             step: int) -> tuple[bytes, str]:
        """The bytes one step's model saw and their hash (StepServed.requestHash)."""
        _, events = await self.turn_state(conversation_id, turn_id, who)
        served = next((e["data"] for e in events if e["type"] == "StepServed" and e["data"]["step"] == step), None)
        if served is None:
            raise ServiceError(f"turn {turn_id} has no step {step}", code="not-found")
        ref = served.get("request")
        if not ref:
            raise ServiceError(f"step {step}'s request was not kept (CTX_KEEP_SERVED_REQUESTS off or the write "
                               "failed)", code="not-found")
        if "body" in ref:  # a small request is kept in the event itself
            return ref["body"].encode("utf-8"), served["requestHash"]
        body = await self.backends.blobs.get_bytes(conversation_id, sha256=ref["sha256"])
        return body, served["requestHash"]

    # ---------- API keys
    async def key_record(self, key_id: str) -> dict[str, Any] | None:
        events = await self.backends.read_stream_all(KEY_STREAM + key_id)
        issued = next((e for e in events if e["type"] == "ApiKeyIssued"), None)
        if issued is None:
            return None
        revoked = next((e for e in events if e["type"] == "ApiKeyRevoked"), None)
        d = issued["data"]
        return {"keyId": key_id, "tenantId": d["tenantId"], "name": d.get("name"), "admin": bool(d.get("admin")),
                "limits": d.get("limits") or {}, "createdAt": issued.get("recordedAt"),
                "revokedAt": revoked.get("recordedAt") if revoked else None}

    async def create_key(self, who: Principal, tenant_id: str, name: str | None, admin: bool,
                         limits: dict[str, int]) -> dict[str, Any]:
        key_id, secret, key = new_key()
        data: dict[str, Any] = {"keyId": key_id, "tenantId": tenant_id, "admin": admin,
                                "secretHash": await asyncio.to_thread(self.auth.hash_secret, secret),
                                "limits": limits}
        if name:
            data["name"] = name
        await self.backends.append(KEY_STREAM + key_id, [new_event("ApiKeyIssued", data)], expected=0)
        await self.backends.append(KEY_INDEX, [new_event("ApiKeyIndexed", {"keyId": key_id, "tenantId": tenant_id})])
        log.info("api-key-issued", key_id=key_id, tenant=tenant_id, admin=admin, by=who.subject)
        return {"keyId": key_id, "key": key, "tenantId": tenant_id, "name": name, "admin": admin, "limits": limits}

    async def list_keys(self, tenant: str | None, revoked: bool) -> list[dict[str, Any]]:
        index = await self.backends.read_stream_all(KEY_INDEX)
        ids = [e["data"]["keyId"] for e in index if tenant is None or e["data"]["tenantId"] == tenant]
        records = [r for r in [await self.key_record(i) for i in ids] if r is not None]
        return [r for r in records if revoked or r["revokedAt"] is None]

    async def revoke_key(self, who: Principal, key_id: str) -> None:
        record = await self.key_record(key_id)
        if record is None:
            raise ServiceError(f"key {key_id} not found", code="not-found")
        if record["revokedAt"] is None:
            await self.backends.append(KEY_STREAM + key_id, [new_event("ApiKeyRevoked", {"keyId": key_id})])
            log.info("api-key-revoked", key_id=key_id, by=who.subject)
        self.auth.forget(key_id)
