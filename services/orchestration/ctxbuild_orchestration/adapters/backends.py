"""Typed calls to the other services over NATS (every payload is validated by its contract on arrival)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import structlog
from ctxbuild_blobclient import BlobClient
from ctxbuild_blobclient.chunks import Content
from ctxbuild_platform.errors import RemoteError
from ctxbuild_platform.rpc import RpcClient
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential_jitter

if TYPE_CHECKING:
    from .work_queue import TurnMessage

log = structlog.get_logger("backends")
T = TypeVar("T")
COMPLETE_TURN_TIMEOUT_S = 30.0  # + 1 s per 256 KiB of the turn's messages
NOT_TRANSIENT = {"version-conflict", "event-id-conflict", "invalid-payload", "not-found"}
TURN_PREFIX = "turn:"
APPENDED_SUBJECT = "ctx.turn.appended"


def followed(stream: str, expected: int | None) -> bool:
    """Whether an append to ``stream`` can have an SSE stream to wake: a turn stream's, unless the append created it
    (expected version 0). A turn is followed by its id, which its creator learns only from the request that creates
    the stream, and the edge answers 404 for a turn whose stream holds no TurnQueued: nobody follows a turn before it
    exists."""
    return stream.startswith(TURN_PREFIX) and expected != 0


async def announce_appended(broker: Any, turn_id: str, to_version: int) -> None:
    """``ctx.turn.appended.<turnId>`` (core NATS, fire and forget) once an append to the turn is stored: wakes the
    SSE streams following it. A lost notice costs them their backstop poll, never an event."""
    try:
        body = json.dumps({"turnId": turn_id, "toVersion": to_version}).encode()
        await broker.connection.publish(f"{APPENDED_SUBJECT}.{turn_id}", body)
    except Exception as exc:  # noqa: BLE001 - the append is stored; the notice is a courtesy
        log.debug("appended-not-announced", turn_id=turn_id, error=str(exc)[:200])


def transient(exc: BaseException) -> bool:
    """A failure that may pass by itself (the service or its database is away for a while): timeouts, no
    responders, an unavailable dependency. Conflicts and refusals are answers, not outages."""
    return isinstance(exc, RemoteError) and bool(exc.retryable) and exc.code not in NOT_TRANSIENT


def not_delivered(exc: BaseException) -> bool:
    """The request reached no one (no responders): nothing ran, so even a non-idempotent call may be sent again."""
    return isinstance(exc, RemoteError) and exc.code == "unavailable" and exc.remote_message == "no responders"


async def patiently(call: Callable[[], Awaitable[T]], *, within_s: float, what: str,
                    when: Callable[[BaseException], bool] = transient) -> T:
    """``call`` retried with jittered exponential backoff (0.25 s → 5 s) while it fails transiently (``when``),
    for at most ``within_s``; then the last failure. Only for idempotent calls (appends by event id, reads), or
    with ``when=not_delivered``."""
    if within_s <= 0:
        return await call()

    def waiting(state: Any) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.warning("retrying", what=what, attempt=state.attempt_number, error=str(exc)[:200],
                    retry_in_s=round(state.next_action.sleep, 2) if state.next_action else None)

    async for attempt in AsyncRetrying(retry=retry_if_exception(when), stop=stop_after_delay(within_s),
                                       wait=wait_exponential_jitter(initial=0.25, max=5.0), reraise=True,
                                       before_sleep=waiting):
        with attempt:
            return await call()
    raise AssertionError("unreachable")  # AsyncRetrying either returns, or reraises the last failure


def new_event(type_: str, data: dict[str, Any], **metadata: Any) -> dict[str, Any]:
    ev = {"eventId": str(uuid.uuid4()), "type": type_, "data": data}
    if metadata:
        ev["metadata"] = metadata
    return ev


class PatientBlobs:
    """The runner's blob client: idempotent calls (content-addressed puts of bytes or text, reads, references)
    retried while the blob store or S3 is away for a while, instead of failing the turn at the first refusal.
    Everything else goes to the client as it is."""

    RETRIED = frozenset({"put", "get_bytes", "get_text", "ref", "release"})

    def __init__(self, client: BlobClient, patience_s: float) -> None:
        self.client = client
        self.patience_s = patience_s

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.client, name)
        if name not in self.RETRIED:
            return attr

        async def call(*args: Any, **kwargs: Any) -> Any:
            if name == "put" and args and not isinstance(args[0], (bytes, str)):
                return await attr(*args, **kwargs)  # a stream is read once: not retryable
            return await patiently(lambda: attr(*args, **kwargs), within_s=self.patience_s, what=f"blob {name}")

        return call


class Backends:
    """``patience_s``: how long persistence calls (appends by event id, reads, the persist lane) are retried while
    persistence or Postgres is away — the runner waits (a turn must reach its terminal event), the edge (0) answers
    503 at once."""

    def __init__(self, rpc: RpcClient, tool_timeout_s: float = 60.0, *, patience_s: float = 0.0,
                 truncate_attempt_s: float = 15.0, truncate_attempts: int = 3, blob_patience_s: float = 0.0) -> None:
        self.rpc = rpc
        self.blob_client = BlobClient(rpc)  # claim check: attachments of any size, bounded memory
        self.blobs: Any = PatientBlobs(self.blob_client, blob_patience_s) if blob_patience_s > 0 else self.blob_client
        self.tool_timeout_s = tool_timeout_s
        self.patience_s = patience_s
        self.truncate_attempt_s = truncate_attempt_s
        self.truncate_attempts = truncate_attempts

    # persistence
    async def append(self, stream: str, events: list[dict[str, Any]], expected: int | None = None,
                     patience_s: float | None = None) -> dict:
        req = {"streamId": stream, "expectedVersion": expected, "events": events}
        reply = await patiently(lambda: self.rpc.call("ctx.persist.append", req),
                                within_s=self.patience_s if patience_s is None else patience_s, what=f"append {stream}")
        if followed(stream, expected):
            await announce_appended(self.rpc.broker, stream[len(TURN_PREFIX):], reply["toVersion"])
        return reply

    async def append_streams(self, groups: list[tuple[str, list[dict[str, Any]], int | None]],
                             patience_s: float | None = None, enqueue: TurnMessage | None = None) -> list[dict]:
        """Append to several streams in ONE commit (``ctx.persist.append_batch``): ``(stream, events, expected)``
        per stream, distinct streams, written in this order; all or nothing — a ``version-conflict`` or
        ``event-id-conflict`` in any group stores none of them. Each group follows :meth:`append`'s rules, so a
        retry of the whole batch by the same event ids is a no-op success. One ``append`` reply per group.
        ``enqueue``: the work-queue message persistence publishes right after the commit; ``enqueue.enqueued`` says
        whether it did (false: publish it yourself)."""
        req: dict[str, Any] = {"appends": [{"streamId": s, "expectedVersion": exp, "events": evs}
                                           for s, evs, exp in groups]}
        if enqueue is not None:
            req["enqueue"] = enqueue.handoff()
        out = await patiently(lambda: self.rpc.call("ctx.persist.append_batch", req),
                              within_s=self.patience_s if patience_s is None else patience_s,
                              what=f"append {', '.join(s for s, _, _ in groups)}")
        if enqueue is not None:
            enqueue.enqueued = out.get("enqueued") is True
        for (stream, _, expected), result in zip(groups, out["results"], strict=False):
            if followed(stream, expected):
                await announce_appended(self.rpc.broker, stream[len(TURN_PREFIX):], result["toVersion"])
        return out["results"]

    async def stream_last(self, stream: str) -> dict:
        """The stream's last event and version in one read: ``{"events": [last] or [], "lastVersion": n, ...}``."""
        return await patiently(lambda: self.rpc.call("ctx.persist.read_stream", {"streamId": stream, "last": True}),
                               within_s=self.patience_s, what=f"read the tail of {stream}")

    async def read_stream(self, stream: str, from_version: int = 1, limit: int | None = None) -> dict:
        req: dict[str, Any] = {"streamId": stream, "fromVersion": from_version}
        if limit:
            req["limit"] = limit
        return await patiently(lambda: self.rpc.call("ctx.persist.read_stream", req), within_s=self.patience_s,
                               what=f"read {stream}")

    async def read_stream_all(self, stream: str, from_version: int = 1) -> list[dict[str, Any]]:
        """Every event of a stream from a version, following ``ctx.persist.read_stream``'s byte-bounded pages."""
        events: list[dict[str, Any]] = []
        nxt = from_version
        while True:
            page = await self.read_stream(stream, nxt)
            events.extend(page["events"])
            if not page.get("more") or not page["events"]:
                return events
            nxt = page["nextVersion"]

    async def complete_turn(self, conversation_id: str, turn_id: str, messages: list[dict[str, Any]],
                            truncate_threshold: int | None, event_id: str | None = None,
                            turn_append: dict[str, Any] | None = None,
                            also_append: list[dict[str, Any]] | None = None,
                            end_notice: dict[str, Any] | None = None) -> dict:
        """The persist lane: oversized outputs not trimmed in flight (e.g. fs_read echoes) become envelopes.
        Idempotent by ``event_id`` (a resumed turn passes the same one). ``turn_append`` ({streamId, expectedVersion,
        events} of the turn's own stream) and ``also_append`` (the same, other streams) are stored in the same
        commit as the messages. ``end_notice`` (with a ``turn_append`` ending the turn): persistence publishes it
        and the turn's appended notice right after that commit; the reply's ``endNoticeSent`` says whether it did
        (then neither is sent from here)."""
        req = {"conversationId": conversation_id, "turnId": turn_id, "eventId": event_id or str(uuid.uuid4()),
               "messages": messages, "settings": {"truncateThreshold": truncate_threshold}}
        if turn_append is not None:
            req["turnAppend"] = turn_append
        if also_append:
            req["alsoAppend"] = also_append
        if end_notice is not None:
            req["endNotice"] = end_notice
        # sized per call: the lane writes the turn's large outputs to the blob store before it appends, so its time
        # grows with the messages; a persistence replica that died with the request costs one such attempt
        size = len(json.dumps(messages, ensure_ascii=False, default=str))
        timeout = min(COMPLETE_TURN_TIMEOUT_S + size / (256 * 1024), 300.0)
        reply = await patiently(lambda: self.rpc.call("ctx.persist.complete_turn", req, timeout=timeout),
                                within_s=self.patience_s, what=f"complete_turn {turn_id}")
        if turn_append is not None and "turnAppend" in reply and reply.get("endNoticeSent") is not True:
            # the turn stream moved too: wake its followers (unless persistence already did)
            await announce_appended(self.rpc.broker, turn_id, reply["turnAppend"]["toVersion"])
        return reply

    async def history(self, conversation_id: str) -> dict:
        """The newest page of the path (its last message is the anchor a new message hangs under)."""
        return await self.rpc.call("ctx.persist.history", {"conversationId": conversation_id})

    async def history_all(self, conversation_id: str, anchor: str | None = None,
                          include_branches: bool = False) -> dict[str, Any]:
        """The whole path root → anchor, following ``ctx.persist.history``'s byte-bounded pages (newest first):
        the newest page's head, every page's messages oldest first, branches merged."""
        req: dict[str, Any] = {"conversationId": conversation_id}
        if include_branches:
            req["includeBranches"] = True
        out: dict[str, Any] | None = None
        older: list[dict[str, Any]] = []
        branches: dict[str, list[str]] = {}
        while True:
            page = await self.rpc.call("ctx.persist.history", {**req, **({"anchorId": anchor} if anchor else {})})
            out = out or page
            older = page["messages"] + older
            branches.update(page.get("branches") or {})
            if not page.get("more") or not page.get("nextAnchorId"):
                break
            anchor = page["nextAnchorId"]
        out = {**out, "messages": older, "start": page.get("start", "root"), "more": False}
        out.pop("nextAnchorId", None)
        out["summaries"] = [{"boundaryId": m["id"], "index": i} for i, m in enumerate(older)
                            if isinstance(m.get("compactionSummary"), str)]
        if include_branches:
            out["branches"] = {m["id"]: branches[m["id"]] for m in older if m["id"] in branches}
        return out

    # compaction
    async def turn_start(self, conversation_id: str, settings: dict[str, Any]) -> dict:
        return await self.rpc.call("ctx.compact.turn_start",
                                   {"conversationId": conversation_id, "settings": settings}, timeout=120)

    # truncation
    async def truncate_step(self, conversation_id: str, turn_id: str, settings: dict[str, Any],
                            parts: list[dict[str, Any]], claims: list[dict[str, Any]] | None = None) -> dict:
        req: dict[str, Any] = {"conversationId": conversation_id, "turnId": turn_id, "settings": settings,
                               "parts": parts}
        if claims:
            req["claims"] = claims
        # idempotent (a pure function of its input; offloads are content-addressed): a short timeout per attempt
        # and another attempt — on another replica of the queue group, most likely — instead of one 120 s wait on
        # a replica that died with the request. The timeout grows with the bytes to trim.
        size = sum(len(str((p.get("output") or {}).get("value", ""))) for p in parts) + sum(
            int(c.get("size", 0)) for c in claims or [])
        timeout = self.truncate_attempt_s + size / (4 * 1024 * 1024)  # +1 s per 4 MiB
        for attempt in range(1, self.truncate_attempts + 1):
            try:
                return await self.rpc.call("ctx.truncate.step", req, timeout=timeout)
            except RemoteError as exc:
                if exc.code not in ("timeout", "unavailable") or attempt == self.truncate_attempts:
                    raise
                log.warning("truncation-retry", turn_id=turn_id, attempt=attempt, error=str(exc)[:200])
        raise AssertionError("unreachable")

    # blob store
    async def attach(self, conversation_id: str, display_name: str, content: Content, media_type: str) -> dict:
        return await self.blobs.attach(content, conversation_id, display_name, media_type)

    # a model's (validated) arguments first, then the server's identity and allow-list: the server's keys win
    async def fs_read(self, conversation_id: str, turn_id: str, args: dict[str, Any],
                      retained: dict[str, Any]) -> dict:
        return await self.rpc.call("ctx.blob.fs_read", {**args, "conversationId": conversation_id,
                                                        "turnId": turn_id, "retained": retained},
                                   timeout=self.tool_timeout_s)

    async def read_file(self, conversation_id: str, turn_id: str, args: dict[str, Any],
                        retained: dict[str, Any]) -> dict:
        return await self.rpc.call("ctx.blob.read_file", {**args, "conversationId": conversation_id,
                                                          "turnId": turn_id, "retained": retained},
                                   timeout=self.tool_timeout_s)

    # MCP catalog
    async def resolve_tools(self, mode: str, server_ids: list[str] | None, *, dialect: str | None = None,
                            context_window: float | None = None, turn_id: str | None = None) -> dict:
        """Tools for a turn; with a dialect the reply carries wire-safe schemas and the deferral decision, and
        with a turn id the catalog keeps the turn's meta-tool state (ctx.mcp.meta)."""
        req: dict[str, Any] = {"mode": mode}
        if server_ids is not None:
            req["serverIds"] = server_ids
        if dialect:
            req["dialect"] = dialect
            req["contextWindow"] = context_window
        if turn_id:
            req["turnId"] = turn_id
        return await self.rpc.call("ctx.mcp.resolve", req, timeout=30)

    async def meta(self, turn_id: str, tool: str, arguments: dict[str, Any], call_id: str) -> dict:
        return await self.rpc.call("ctx.mcp.meta", {"arguments": arguments, "tool": tool, "turnId": turn_id,
                                                    "callId": call_id}, timeout=self.tool_timeout_s)

    async def invoke(self, tool_id: str, arguments: dict[str, Any], call_id: str, turn_id: str | None = None) -> dict:
        req: dict[str, Any] = {"toolId": tool_id, "arguments": arguments, "callId": call_id}
        if turn_id:
            req["turnId"] = turn_id  # the catalog runs a call of a turn at most once (a resumed turn asks again)
        return await self.rpc.call("ctx.mcp.invoke", req, timeout=self.tool_timeout_s)
