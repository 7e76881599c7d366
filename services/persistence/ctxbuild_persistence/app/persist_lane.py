"""``ctx.persist.complete_turn``: the persist lane (SPEC §7) end to end.

1. Plan: the codec library decides, per tool-result part of the turn's ``tool`` messages, what to offload
   (``plan_persist``: same policies/codecs/primitive as in flight; fs_read and read_file echoes go through the
   text-field codec or the opaque lane — finding #3).
2. Blobs first: every full text goes to the blob store (``ctx.blob.put``, role ``tool_output``, owner = the
   message). Content-addressed and idempotent: a retry writes nothing new. Writes run concurrently; one that
   fails leaves its part with the full output ("better fat than lost").
3. Apply: the parts become ``persisted`` outputs holding v1/v2 envelopes (``apply_persist``).
4. Events stay small (SPEC §15.1): a message whose parts are over 16 KiB of JSON stores them as one content
   reference (``ctxbuild_blobclient.content_ref``, owned ``tool_output`` by the message, so GC keeps it), and the
   messages are packed into as many ``AssistantMessageCompleted`` events as needed (each ≤ ``event_budget`` of
   messages), appended in ONE append (one transaction; idempotent by ``eventId`` — the later events' ids derive
   from it; expected version of the conversation stream). The references exist before the events commit, so a
   committed event never names a blob without a reference. Parts that arrive by reference are read back first.
   Large texts (over one NATS message) take the blob store's chunked upload (``ctxbuild_blobclient``).
5. The event did not commit, for certain (version conflict, invalid event): the references this call added for
   messages that are not stored are released (``ctx.blob.release``) so the blobs become unreferenced and the
   blob store's GC collects them after its grace period. An ambiguous failure (database unreachable: the commit
   may have happened) releases nothing — a leaked reference costs storage, a released one could lose data; the
   caller retries with the same eventId.

With ``turnAppend`` (the turn's own events, e.g. its last StepServed and TurnCompleted) step 4's append carries them
too: both streams in ONE transaction (``EventStore.append_batch``), so a turn's end is one commit — stored whole or
not at all, a retry of the whole request a no-op. ``alsoAppend`` adds other streams' appends to the same commit
(a gateway answer's prefix record). They are checked before any blob is written. ``endNotice`` (the turn's end
notice, with a ``turnAppend`` holding its terminal event) is published right after that commit — also when a retry
finds it already stored — and before the reply (``adapters.notices``), so the edge waiting for the turn hears of
its end one hop sooner than through the runner; the reply's ``endNoticeSent`` tells the runner not to send it too.

Outputs the in-flight lane already offloaded (typed ``offload`` with a sha256) are stored as they are; their
blob gets a ``tool_output`` reference owned by the message (``ctx.blob.ref``, promoted from the turn's
provisional one) when the blob store offers that subject.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

import structlog
from ctxbuild_codec import persist_threshold
from ctxbuild_codec.models.subjects.ctx_persist_complete_turn_reply import PersistCompleteTurnReply
from ctxbuild_codec.records import archived_blobs, offload_of
from ctxbuild_platform import contracts
from ctxbuild_platform.errors import Conflict, DependencyUnavailable, InvalidPayload
from ctxbuild_platform.telemetry import span

from ..adapters.blobs import LaneBlobs
from ..adapters.event_store import AppendPart, EventStore, dumps
from ..adapters.notices import TurnNotices
from ..domain.append import NewEvent
from ..domain.conversation import conversation_stream, fold
from ..domain.persist_lane import BlobWrite, apply_turn, blob_writes, plan_turn, turn_stream
from .models import AppendEvent, CompleteTurnRequest

log = structlog.get_logger("persist_lane")
ENVELOPE_CONTRACT = "envelopes/envelope.json"
TERMINAL_TYPES = ("TurnCompleted", "TurnFailed")


def _valid_envelopes(messages: Sequence[dict[str, Any]]) -> None:
    """A self-check: every envelope the lane produced validates against contracts/envelopes (when present)."""
    if not contracts.has_contract(ENVELOPE_CONTRACT):
        return
    for m in messages:
        for p in m.get("parts") or []:
            out = p.get("output") if isinstance(p, dict) else None
            if isinstance(out, dict) and out.get("type") == "persisted":
                contracts.validate(ENVELOPE_CONTRACT, out["value"])


def inflight_offloads(messages: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """(message id, sha256) of every blob the in-flight lane offloaded (typed provenance,
    ``ctxbuild_codec.records``): the single blob of an opaque offload, each per-field blob of a codec offload
    (``offload.blobs``: web results, read echoes) and the original of a non-text output. Each gets a tool_output
    reference owned by the message, so releasing the turn's provisional references at its end never strands a
    trimmed entity."""
    out: dict[tuple[str, str], None] = {}
    for m in messages:
        if m.get("role") != "tool":
            continue
        for p in m.get("parts") or []:
            if isinstance(p, dict) and offload_of(p) is not None:
                for blob in archived_blobs({**p, "output": None}):  # the offload's blobs, not an envelope's
                    if blob.sha256 is not None:
                        out.setdefault((m["id"], blob.sha256), None)
    return list(out)


def completed_events(turn: Mapping[str, Any], messages: Sequence[dict[str, Any]],
                     budget: int) -> list[dict[str, Any]]:
    """The turn's AssistantMessageCompleted events (``turn``: its eventId, turnId, usage and metadata as JSON): its
    messages in order, as many per event as fit ``budget`` bytes of JSON (large parts are already references, so
    every message is small). The first event has the request's eventId, the others ids derived from it: a retry
    appends the same events, all duplicates."""
    groups: list[list[dict[str, Any]]] = [[]]
    used = 0
    for m in messages:
        size = len(dumps(m).encode("utf-8", "surrogatepass")) + 1
        if groups[-1] and used + size > budget:
            groups.append([])
            used = 0
        groups[-1].append(m)
        used += size
    first = turn["eventId"]
    out = []
    for i, group in enumerate(groups):
        data: dict[str, Any] = {"turnId": turn["turnId"], "messages": group}
        if i == len(groups) - 1 and turn.get("usage") is not None:
            data["usage"] = turn["usage"]
        eid = first if i == 0 else str(uuid.uuid5(uuid.UUID(first), f"AssistantMessageCompleted/{i}"))
        event = {"eventId": eid, "type": "AssistantMessageCompleted", "data": data}
        if turn.get("metadata"):
            event["metadata"] = turn["metadata"]
        out.append(event)
    return out


@dataclass
class PersistLane:
    """``ctx.persist.complete_turn`` (the module doc tells the steps)."""

    store: EventStore
    blobs: LaneBlobs
    to_events: Callable[[Sequence[AppendEvent], str], list[NewEvent]]
    on_appended: Callable[[], None]
    _: KW_ONLY
    promote_inflight_refs: bool = True
    notices: TurnNotices | None = None  # None: an endNotice is refused (no connection to send it on)
    event_budget: int = 48 * 1024  # messages' JSON per event, leaving room for metadata (trace context)

    async def complete_turn(self, req: CompleteTurnRequest) -> PersistCompleteTurnReply:
        cid, turn_id = req.conversationId, req.turnId
        turn_part = self._turn_part(req)  # refused before anything is written
        also_parts = self._also_parts(req)
        self._check_end_notice(req)
        notice_sent: bool | None = None
        messages: list[dict[str, Any]] = await asyncio.gather(
            *(self.blobs.resolve_parts(cid, m) for m in req.messages))
        threshold = persist_threshold(req.settings.truncateThreshold if req.settings is not None else None)
        with span("persist.lane", **{"ctx.conversation_id": cid, "ctx.turn_id": turn_id}) as sp:
            plans = await asyncio.to_thread(plan_turn, messages, threshold) if _big(messages) \
                else plan_turn(messages, threshold)
            writes = blob_writes(plans)
            uris = await asyncio.gather(*(self.blobs.put(cid, w) for w in writes))
            written = {(w.message_id, w.sha256): uri for w, uri in zip(writes, uris, strict=True)}
            stored, report = apply_turn(messages, plans, written)
            try:
                _valid_envelopes(stored)
            except InvalidPayload as exc:  # a codec bug must not store an unreadable envelope: keep it whole
                log.error("envelope-invalid", error=exc.message)
                stored, report = apply_turn(messages, plans, {})
            promoted = failed_refs = 0
            owners = {w.message_id for w in writes}  # messages this call gave references to
            if self.promote_inflight_refs:
                pairs = inflight_offloads(messages)
                ok = await asyncio.gather(*(self.blobs.ref(cid, mid, sha) for mid, sha in pairs))
                promoted, failed_refs = sum(ok), len(ok) - sum(ok)
                owners |= {mid for (mid, _), done in zip(pairs, ok, strict=True) if done}
            try:
                small = await asyncio.gather(*(self.blobs.small_parts(cid, m, self.event_budget) for m in stored))
            except Exception as exc:
                if owners:
                    await self._release_unstored(cid, owners)
                log.warning("content-ref-failed", conversation=cid, turn=turn_id,
                            error=f"{type(exc).__name__}: {exc}"[:300])
                raise DependencyUnavailable(f"persist lane: large message parts could not be stored: "
                                            f"{type(exc).__name__}") from exc
            owners |= {m["id"] for m, s_ in zip(stored, small, strict=True) if s_ is not m}
            turn = {"eventId": str(req.eventId), "turnId": turn_id, "usage": req.usage, "metadata": req.metadata}
            events = completed_events(turn, small, self.event_budget)
            stream = conversation_stream(cid)
            conv_part = AppendPart(stream, req.expectedVersion, self.to_events(
                [AppendEvent.model_validate(e) for e in events], stream))
            try:
                parts = [conv_part, *([turn_part] if turn_part is not None else []), *also_parts]
                results = await self.store.append_batch(parts)
            except (Conflict, InvalidPayload) as exc:
                log.warning("complete-turn-refused", conversation=cid, turn=turn_id, code=exc.code,
                            error=exc.message[:300])
                if owners:
                    await self._release_unstored(cid, owners)
                raise
            if req.endNotice is not None and self.notices is not None:  # the turn has ended: tell its waiter now
                notice_sent = await self.notices.turn_ended(turn_id, results[1]["toVersion"], req.endNotice)
            result = results[0]
            if any(r["duplicates"] < len(p.events) for r, p in zip(results, parts, strict=True)):
                self.on_appended()
            elif writes:
                await self._release_unused(result["positions"], writes, uris, cid)
            sp.set_attribute("ctx.persist.events", len(events))
            sp.set_attribute("ctx.persist.parts", len(report))
            sp.set_attribute("ctx.persist.blobs", sum(1 for u in uris if u))
        out: dict[str, Any] = {"append": result, "threshold": threshold, "parts": report}
        if turn_part is not None:
            out["turnAppend"] = results[1]
        if also_parts:
            out["alsoAppend"] = results[len(results) - len(also_parts):]
        if notice_sent is not None:
            out["endNoticeSent"] = notice_sent
        if self.promote_inflight_refs:
            out["references"] = {"promoted": promoted, "failed": failed_refs}
        return PersistCompleteTurnReply.model_validate(out)

    def _turn_part(self, req: CompleteTurnRequest) -> AppendPart | None:
        """The request's own turn events as the second part of the one commit: only the turn's stream."""
        extra = req.turnAppend
        if extra is None:
            return None
        if extra.streamId != turn_stream(req.turnId):
            raise InvalidPayload(f"turnAppend: only {turn_stream(req.turnId)!r} is appended with the turn's messages, "
                                 f"not {extra.streamId!r}", details={"streamId": extra.streamId})
        try:
            return AppendPart(extra.streamId, extra.expectedVersion, self.to_events(extra.events, extra.streamId))
        except InvalidPayload as exc:
            raise InvalidPayload(f"turnAppend: {exc.message}", details=exc.details) from exc

    def _check_end_notice(self, req: CompleteTurnRequest) -> None:
        """An end notice goes out only with the commit that stores the turn's end, and says what that end is."""
        notice = req.endNotice
        if notice is None:
            return
        if self.notices is None:
            raise InvalidPayload("endNotice: this persistence has no connection to publish it on")
        terminals = [e.type for e in (req.turnAppend.events if req.turnAppend is not None else [])
                     if e.type in TERMINAL_TYPES]
        if not terminals:
            raise InvalidPayload("endNotice: only with a turnAppend that holds the turn's terminal event "
                                 f"({' or '.join(TERMINAL_TYPES)})")
        if notice.get("type") != terminals[-1] or notice.get("turnId") != req.turnId:
            raise InvalidPayload(f"endNotice: says {notice.get('type')!r} of {notice.get('turnId')!r}; the turnAppend "
                                 f"ends {req.turnId!r} with {terminals[-1]!r}",
                                 details={"type": notice.get("type"), "terminal": terminals[-1]})

    def _also_parts(self, req: CompleteTurnRequest) -> list[AppendPart]:
        """The request's appends to other streams, after the turn's in the one commit: never the conversation's or
        the turn's stream, each stream once."""
        seen = {conversation_stream(req.conversationId), turn_stream(req.turnId)}
        parts: list[AppendPart] = []
        for g, extra in enumerate(req.alsoAppend or []):
            if extra.streamId in seen:
                raise InvalidPayload(f"alsoAppend/{g}: stream {extra.streamId!r} is the conversation's, the turn's "
                                     "or named twice", details={"groupIndex": g, "streamId": extra.streamId})
            seen.add(extra.streamId)
            try:
                parts.append(AppendPart(extra.streamId, extra.expectedVersion,
                                        self.to_events(extra.events, extra.streamId)))
            except InvalidPayload as exc:
                raise InvalidPayload(f"alsoAppend/{g}: {exc.message}",
                                     details={**(exc.details or {}), "groupIndex": g}) from exc
        return parts

    async def _release_unused(self, positions: Sequence[int], writes: Sequence[BlobWrite],
                              uris: Sequence[str | None], conversation_id: str) -> None:
        """A retry found its events already stored: references this attempt added for blobs the stored messages
        do not name (e.g. the first attempt kept a full output while the blob store was down) are released, so
        the references match what was committed. Only the messages this attempt wrote blobs for are read back
        (their parts may be a content reference)."""
        written = {w.message_id for w, uri in zip(writes, uris, strict=True) if uri is not None}
        if not written:
            return
        try:
            named: set[tuple[str, str]] = set()
            for position in positions:
                stored = await self.store.event_at(position)
                for m in (stored or {}).get("data", {}).get("messages", []):
                    if m.get("id") in written:
                        m = await self.blobs.resolve_parts(conversation_id, m)
                        named |= {(m["id"], sha) for sha in _named_blobs(m)}
        except Exception as exc:  # noqa: BLE001 - keep the references (storage), never lose a named blob
            log.warning("release-skipped", error=f"{type(exc).__name__}: {exc}"[:200])
            return
        for w, uri in zip(writes, uris, strict=True):
            if uri is not None and (w.message_id, w.sha256) not in named:
                await self.blobs.release(w.message_id, w.sha256)

    async def _release_unstored(self, conversation_id: str, message_ids: set[str]) -> None:
        """The event is known not to be stored: release the references of messages the stream does not hold
        (a message id already stored — e.g. by an earlier attempt — keeps its references)."""
        try:
            conv = fold(conversation_id, await self.store.stream_events(conversation_stream(conversation_id)))
        except Exception as exc:  # noqa: BLE001 - cannot tell what is stored: release nothing
            log.warning("release-skipped", error=f"{type(exc).__name__}: {exc}"[:200])
            return
        for mid in sorted(message_ids - set(conv.messages)):
            await self.blobs.release(mid)


def _named_blobs(message: dict[str, Any]) -> set[str]:
    """sha256s of the blobs a stored message names (``ctxbuild_codec.records``: its persisted envelopes'
    blobs and originals, and any in-flight offload's)."""
    return {b.sha256 for p in message.get("parts") or [] for b in archived_blobs(p) if b.sha256 is not None}


def _big(messages: Sequence[dict[str, Any]], limit: int = 1 << 20) -> bool:
    """Rough size check: plan big turns on a thread (sha256 and line counts over MBs of text)."""
    total = 0
    for m in messages:
        for p in m.get("parts") or []:
            out = p.get("output") if isinstance(p, dict) else None
            if isinstance(out, dict) and isinstance(out.get("value"), str):
                total += len(out["value"])
                if total > limit:
                    return True
    return False

