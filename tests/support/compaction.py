"""Doubles for the compaction and content-reference tests: an in-memory blob store (what those callers use of
``ctxbuild_blobclient.BlobClient``: put, get_bytes, get_result; content-addressed like the real one), persistence
with nothing to read back, a tool result trimmed in flight as the truncation service records it, and the runner's
side of the in-loop protocol."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable

from ctxbuild_codec import apply_inflight, envelopes, nontext, plan_inflight, vfs_uri
from ctxbuild_codec.lanes import trim_records
from ctxbuild_platform import contracts
from ctxbuild_platform.rpc import dispatch, request_model


class MemoryBlobs:
    """Blobs by sha256, every reference taken ``(sha256, owner, role)`` and the number of reads."""

    def __init__(self):
        self.objects: dict[str, bytes] = {}
        self.refs: list[tuple[str, object, str]] = []
        self.members: dict[str, list[str]] = {}  # a transcript sha256 → the member URIs its put declared
        self.gets = 0

    async def put(self, content, conversation_id, owner, role, *, media_type=None, members=None):
        body = content if isinstance(content, bytes) else content.encode()
        sha = hashlib.sha256(body).hexdigest()
        if members:
            self.members[sha] = list(members)
        self.objects[sha] = body
        self.refs.append((sha, owner, role))
        return {"sha256": sha, "uri": vfs_uri(sha), "size": len(body)}

    async def get_bytes(self, conversation_id, *, sha256=None, uri=None):
        if (sha256 is None) == (uri is None):
            raise ValueError("pass exactly one of sha256 or uri")  # as BlobClient does
        self.gets += 1
        if sha256 is None:
            sha256 = next(s for s in self.objects if vfs_uri(s) == uri)
        return self.objects[sha256]

    async def get_result(self, conversation_id, envelope=None, *, offload=None):
        """As ``ctx.blob.get_result`` answers: the original output a persisted envelope or an offload names."""
        if offload is not None:
            original = offload["original"]
            text = self.objects[original["sha256"]].decode()
            return {"output": nontext.read_back(original["of"], original["type"], text), "gone": []}
        texts = {sha: self.objects[sha].decode() if sha in self.objects else None
                 for sha in envelopes.blob_ids(envelope)}
        return {"output": envelopes.inflate(envelope, texts), "gone": [s for s, t in texts.items() if t is None]}

    def text(self, uri: str) -> str:
        return next(b for s, b in self.objects.items() if vfs_uri(s) == uri).decode()


class NoHistory:
    """Persistence as the in-loop use case sees it on a fresh turn: no checkpoint to read back."""

    async def last_fold(self, turn_id):
        return None


def trim_as_truncation(part, threshold, store):
    """``trim_inflight`` plus what the truncation service adds to a codec offload: ``offload.blobs``, one row per
    trimmed field (``store(blob) -> uri | None`` as for the codec)."""
    plan = plan_inflight(part, threshold)
    if plan is None:
        return dict(part)
    written = {b.sha256: store(b) for b in plan.blobs}
    out = apply_inflight(part, plan, written)
    if plan.route == "codec" and (out.get("offload") or {}).get("mode") == "offloaded":
        out["offload"]["blobs"] = [{"key": r.key, "uri": r.uri, "sha256": r.sha256, "totalChars": r.total_chars,
                                    "totalLines": r.total_lines}
                                   for r in trim_records(plan, written) if r.mode == "offloaded"]
    return out


TIMING = ("startedAt", "completedAt", "durationMs")


def untimed(reply: dict) -> dict:
    """A compaction reply without the decision's timing (the only fields two runs of one request may differ in)."""
    return {**reply, "decision": {k: v for k, v in reply["decision"].items() if k not in TIMING}}


async def typed(subject: str, handler, request: dict) -> dict:
    """``request`` answered as ``@rpc`` answers it: validated, parsed into the handler's model, reply dumped."""
    reply = await dispatch(subject, json.dumps(request).encode(), handler, request_model(subject, handler))
    assert "result" in reply, reply
    return reply["result"]


async def in_loop_turn(steps: int, messages: list[dict], next_rows: Callable[[int, dict], Awaitable[list[dict]]], *,
                       serve: Callable[[dict], Awaitable[dict]], window: int, fixed: int, conversation_id: str = "conv",
                       turn_id: str = "t") -> list[tuple[dict, dict]]:
    """The runner's side of the loop: each step sends the previous reply's checkpoint and only the messages it has
    not consumed (``serve`` answers ``ctx.compact.in_loop``; both ends contract-checked), then appends the step's
    rows (``await next_rows(step, reply)``). Returns each step's (reply, request)."""
    ck, out = None, []
    for step in range(1, steps + 1):
        offset = ck["consumedCount"] if ck else 0
        req = {"conversationId": conversation_id, "turnId": turn_id, "step": step, "offset": offset,
               "messages": messages[offset:], "checkpoint": ck, "fixedTokens": fixed,
               "settings": {"contextWindow": window}}
        contracts.validate("subjects/ctx.compact.in_loop.request.json", req)
        reply = await serve(json.loads(json.dumps(req)))
        contracts.validate("subjects/ctx.compact.in_loop.reply.json", reply)
        out.append((reply, req))
        ck = reply["checkpoint"]
        messages += await next_rows(step, reply)
    return out
