"""Doubles for the compaction and content-reference tests: an in-memory blob store (what those callers use of
``ctxbuild_blobclient.BlobClient``: put, get_bytes, get_result; content-addressed like the real one), persistence
with nothing to read back, and a tool result trimmed in flight as the truncation service records it."""

from __future__ import annotations

import hashlib

from ctxbuild_codec import apply_inflight, envelopes, nontext, plan_inflight, vfs_uri
from ctxbuild_codec.lanes import records as trim_records


class MemoryBlobs:
    """Blobs by sha256, every reference taken ``(sha256, owner, role)`` and the number of reads."""

    def __init__(self):
        self.objects: dict[str, bytes] = {}
        self.refs: list[tuple[str, object, str]] = []
        self.gets = 0

    async def put(self, content, conversation_id, owner, role, *, media_type=None):
        body = content if isinstance(content, bytes) else content.encode()
        sha = hashlib.sha256(body).hexdigest()
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
    if plan.route == "codec" and out["offload"]["mode"] == "offloaded":
        out["offload"]["blobs"] = [{"key": r.key, "uri": r.uri, "sha256": r.sha256, "totalChars": r.total_chars,
                                    "totalLines": r.total_lines}
                                   for r in trim_records(plan, written) if r.mode == "offloaded"]
    return out
