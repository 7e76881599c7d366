"""The blob store as seen from compaction, through ``ctxbuild_blobclient.BlobClient`` (its ``put`` picks the inline
or the claim-check transfer by size, so a large transcript or masked output streams; ``get_bytes`` and
``get_result`` read back):

- masking archives an output's full text with a ``tool_output`` reference owned by the turn, so the masked
  marker's URI is readable with fs_read — also after the turn, when its provisional references are released
  (a served request's links stay readable: lossless, SPEC §15.2);
- an in-loop checkpoint's compacted prefix travels and is recorded by reference when it is large (SPEC §15.1:
  events stay small). The prefix blob is provisional to the turn: the runner releases the turn's provisional
  references once the turn is terminal, and nothing needs the checkpoint after that;
- a fold's transcript (SPEC §15.2) is archived with a ``tool_output`` reference owned by the turn (or the
  conversation when there is no turn): it is not released with the turn's provisional blobs, because a stored
  turn-start summary names it for every later turn. Outputs offloaded or persisted before the fold are read back
  to their originals first (as the UI read-back does), so the transcript holds every output in full. The folded
  rows' archived URIs are declared as the transcript's members: the blob store keeps them readable while the
  transcript is in a read's retained context (a summary may quote a folded marker's link).
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import structlog
from ctxbuild_blobclient import BlobClient, content_ref
from ctxbuild_codec import assemble
from ctxbuild_codec.records import archived_uris, offload_of

from ..domain.transcript import MEDIA_TYPE, needs_full, render_transcript

log = structlog.get_logger("compaction.blobstore")
CHECKPOINT_ROLE = "provisional"
MAX_MEMBERS = 10_000  # ctx.blob.put `members` maxItems (a larger list would lose the transcript)


class Blobs(content_ref.BlobPort, Protocol):
    """What compaction uses of :class:`BlobClient` (tests pass an in-memory double)."""

    async def get_result(self, conversation_id: str, envelope: Mapping[str, Any] | None = None, *,
                         offload: Mapping[str, Any] | None = None) -> dict[str, Any]: ...


class CachedBlobs:
    """A BlobPort whose reads are cached by sha256 (content-addressed, so a cached body never goes stale).
    A turn's checkpoint is read back on every step while it is unchanged; the cache makes that one read per
    replica, and a body this replica just stored is not read back at all."""

    def __init__(self, blobs: content_ref.BlobPort, max_bytes: int = 32 * 1024 * 1024) -> None:
        self.blobs = blobs
        self.max_bytes = max_bytes
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._size = 0

    def _keep(self, sha256: str, body: bytes) -> None:
        if len(body) > self.max_bytes or sha256 in self._cache:
            return
        self._cache[sha256] = body
        self._size += len(body)
        while self._size > self.max_bytes:
            _, old = self._cache.popitem(last=False)
            self._size -= len(old)

    async def put(self, content: Any, conversation_id: str, owner: Any, role: str, *,
                  media_type: str | None = None, members: Sequence[str] | None = None) -> dict[str, Any]:
        kw = {"members": list(members)} if members else {}
        reply = await self.blobs.put(content, conversation_id, owner, role, media_type=media_type, **kw)
        if isinstance(content, bytes):
            self._keep(reply["sha256"], content)
        return reply

    async def get_bytes(self, conversation_id: str, *, sha256: str | None = None,
                        uri: str | None = None) -> bytes:
        if sha256 is not None and sha256 in self._cache:
            self._cache.move_to_end(sha256)
            return self._cache[sha256]
        body = await self.blobs.get_bytes(conversation_id, sha256=sha256, uri=uri)
        if sha256 is not None:
            self._keep(sha256, body)
        return body


class BlobStore:
    def __init__(self, blobs: BlobClient | Blobs, timeout_s: float) -> None:
        self.raw = blobs
        self.blobs = CachedBlobs(blobs)
        self.timeout_s = timeout_s  # masking: an archive write slower than this keeps the output

    async def _text(self, conversation_id: str, ref: Mapping[str, Any]) -> str:
        """The text of the blob a record names: by its sha256 (cached) when it has one, else by its URI."""
        sha256 = ref.get("sha256")
        body = await self.blobs.get_bytes(conversation_id, sha256=sha256, uri=None if sha256 else ref.get("uri"))
        return body.decode("utf-8", "surrogatepass")

    async def full_output(self, part: Mapping[str, Any], conversation_id: str) -> dict[str, Any] | None:
        """The original output of a trimmed tool result (None: not trimmed, or not readable back)."""
        output = part.get("output") or {}
        if output.get("type") == "persisted":
            return (await self.raw.get_result(conversation_id, output["value"]))["output"]
        off = offload_of(part)
        if off is None:
            return None
        if isinstance(off.get("original"), Mapping):
            return (await self.raw.get_result(conversation_id, offload=off))["output"]
        if off.get("blobs") and output.get("type") in ("json", "error-json"):
            texts = {b["key"]: await self._text(conversation_id, b) for b in off["blobs"]}
            value = output["value"]
            parsed = json.loads(value) if isinstance(value, str) else value
            return {"type": output["type"], "value": assemble(parsed, texts)}
        if off.get("sha256") or off.get("uri"):
            text = await self._text(conversation_id, off)
            return {"type": "error-text" if str(output.get("type", "")).startswith("error") else "text",
                    "value": text}
        return None

    async def full_rows(self, rows: Sequence[Mapping[str, Any]], conversation_id: str) -> list[dict[str, Any]]:
        """``rows`` with every trimmed output replaced by its original; one that cannot be read back keeps its
        served form (its marker still names the blob)."""
        out: list[dict[str, Any]] = []
        for row in rows:
            parts = row.get("parts") or []
            if not any(needs_full(p) for p in parts):
                out.append(dict(row))
                continue
            new_parts = []
            for p in parts:
                full = None
                if needs_full(p):
                    try:
                        full = await self.full_output(p, conversation_id)
                    except Exception as exc:  # noqa: BLE001 - gone or unreadable: the served form stays
                        log.warning("transcript-output-unresolved", conversation_id=conversation_id,
                                    error=f"{type(exc).__name__}: {exc}"[:300])
                new_parts.append({**p, "output": full} if full is not None else p)
            out.append({**row, "parts": new_parts})
        return out

    async def archive(self, rows: Sequence[Mapping[str, Any]], conversation_id: str,
                      turn_id: str | None) -> str | None:
        """Archive the transcript of a fold's rows; its URI, or None on any failure (the fold still serves)."""
        if not conversation_id or not rows:
            return None
        owner = ("turn", turn_id) if turn_id else ("conversation", conversation_id)
        try:
            text = render_transcript(await self.full_rows(rows, conversation_id))
            # the folded rows' own outputs stay readable while this transcript is retained (SPEC §15.2: a fold
            # revokes nothing; the summary may quote their links) — server-side membership, not a longer trailer
            members = archived_uris(rows)[-MAX_MEMBERS:]
            reply = await self.blobs.put(text.encode("utf-8", "replace"), conversation_id, owner,
                                         "tool_output", media_type=MEDIA_TYPE, members=members)
            return str(reply["uri"])
        except Exception as exc:  # noqa: BLE001 - the fold is served without its transcript link
            log.warning("transcript-not-archived", conversation_id=conversation_id,
                        error=f"{type(exc).__name__}: {exc}"[:300])
            return None

    async def put(self, text: str, conversation_id: str, turn_id: str | None) -> str | None:
        """The archived URI, or None on any failure (the output then stays in full — never fails the fold)."""
        if not conversation_id:
            return None
        owner = ("turn", turn_id) if turn_id else ("conversation", conversation_id)
        try:
            reply = await asyncio.wait_for(self.blobs.put(
                text, conversation_id, owner, "tool_output", media_type="text/plain"),
                self.timeout_s)
            return str(reply["uri"])
        except Exception as exc:  # noqa: BLE001 - unavailable, too large, malformed: keep the output
            log.warning("blob-put-failed", conversation_id=conversation_id, error=f"{type(exc).__name__}: {exc}"[:300])
            return None

    async def resolve_checkpoint(self, checkpoint: dict[str, Any], conversation_id: str) -> dict[str, Any]:
        """The checkpoint with its compacted prefix inline (a RemoteError propagates: without the prefix the
        messages sent from its consumedCount on cannot be served)."""
        prefix = checkpoint.get("compactedPrefix")
        if not content_ref.is_ref(prefix):
            return checkpoint
        return {**checkpoint, "compactedPrefix": await content_ref.resolve(self.blobs, prefix, conversation_id)}

    async def checkpoint_by_reference(self, checkpoint: dict[str, Any], conversation_id: str,
                                      turn_id: str) -> dict[str, Any]:
        """The checkpoint with a large compacted prefix stored as a blob of the turn and named by reference;
        on a failed write it stays inline (the runner stores it before recording it)."""
        prefix = checkpoint.get("compactedPrefix")
        try:
            ref = await content_ref.store_if_large(self.blobs, prefix, conversation_id, ("turn", turn_id),
                                                   CHECKPOINT_ROLE)
        except Exception as exc:  # noqa: BLE001 - the reply still carries the checkpoint, inline
            log.warning("checkpoint-put-failed", turn_id=turn_id, error=f"{type(exc).__name__}: {exc}"[:300])
            return checkpoint
        return {**checkpoint, "compactedPrefix": ref}
