"""The pure halves of both lanes (SPEC §5, §7): one trim path, the blob writes left to the services.

    plan = plan_inflight(part, threshold)          # or plan_persist(part, persist_threshold(configured))
    if plan is not None:
        written = {b.sha256: await put(b.text) for b in plan.blobs}   # the URI the store acknowledged, or None
        part = apply_inflight(part, plan, written)  # or apply_persist(...)

A plan is a pure function of (part, threshold); apply is a pure function of (part, plan, written). Both lanes
pick the codec from the same policy table (by ``effectiveToolName``), cut with the same primitive (§3) and name
blobs by the same sha256, which is why a persisted envelope renders back to the in-flight bytes
(:func:`ctxbuild_codec.envelopes.render`).

``written`` maps sha256 → URI; a missing entry, ``None`` or a URI that is not ``vfs_uri(sha256)`` is a failed
write. In flight a failed write means the inline excerpt (opaque lane) or the full text (that entity); at persist
time it means the full text stays ("better fat than lost").
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Literal, NamedTuple

from .codecs import ERROR_TYPES, assemble, content_texts, deflate, extract_text, snippet
from .nontext import OF_OUTPUT, OF_VALUE, describe, has_nontext, original_text, render_with_markers
from .policy import policy_for
from .trim import (
    HEAD_CHARS,
    PERSIST_MIN_CHARS,
    TAIL_CHARS,
    VFS_SCHEME,
    Excerpt,
    excerpt,
    inline_truncate,
    needs_trim,
    render_marker,
    vfs_handle,
)

Lane = Literal["inflight", "persist"]
Route = Literal["opaque", "codec"]
ORIGINAL_KEY = "#original"  # the cut of an original output's blob (never a JSON-pointer-lite key: no leading /)
JSON_TYPES = ("json", "error-json")

# Texts this large are hashed on a worker thread (hashlib releases the GIL) while this one counts their lines.
PARALLEL_MIN_BYTES = 1 << 20
# Texts this large have their newlines counted with numpy (SIMD, ~5x bytes.count, GIL released).
NUMPY_COUNT_MIN_BYTES = 1 << 16
_pool: ThreadPoolExecutor | None = None
# A trimmed text's marker (head ≤ 500 + tail ≤ 1,000 + ≤ ~300 chars of <persisted-output> block) is never longer.
TRIMMED_MAX_CHARS = HEAD_CHARS + TAIL_CHARS + 400


def _hash_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="codec-sha256")
    return _pool


def count_newlines(data: bytes) -> int:
    """Newlines in UTF-8 bytes (== in the text: 0x0A never occurs inside a multi-byte sequence)."""
    if len(data) < NUMPY_COUNT_MIN_BYTES:
        return data.count(b"\n")
    import numpy as np  # imported on first large text only

    return int(np.count_nonzero(np.frombuffer(data, dtype=np.uint8) == 10))


def _forget_pool_after_fork() -> None:
    global _pool
    _pool = None  # a forked child has no worker thread: it makes its own on first use


os.register_at_fork(after_in_child=_forget_pool_after_fork)


_new_sha256 = hashlib.sha256
_tuple_new = tuple.__new__


def _sha256(data: bytes, started: threading.Event) -> str:
    h = hashlib.sha256()
    started.set()  # the caller resumes once update() below has released the GIL
    h.update(data)
    return h.hexdigest()


class Cut(NamedTuple):
    """One text to trim, measured once for both lanes: where it sits, its blob identity, its §3 excerpt.

    ``key`` is JSON-pointer-lite (``""`` for a whole output). A cut is also the blob to write: ``sha256``,
    ``text`` and the ``uri`` a marker will show. ``sha256``/``uri`` are None when the text cannot be stored (not
    encodable as UTF-8, e.g. lone surrogates): in flight it is then cut inline, at persist time kept whole.
    """

    key: str
    sha256: str | None
    uri: str | None
    text: str
    head: str
    tail: str
    total_lines: int
    total_chars: int

    @property
    def excerpt(self) -> Excerpt:
        return Excerpt(self.head, self.tail, self.total_lines, self.total_chars)


BlobToWrite = Cut  # what a service puts into the blob store: ``.sha256``, ``.text`` (and ``.uri`` to expect)


@dataclass(frozen=True, slots=True)
class Original:
    """An opaque plan's original output (SPEC §15.1, :mod:`ctxbuild_codec.nontext`): ``of: output`` — a content
    output with non-text parts, stored whole as the cut keyed ``ORIGINAL_KEY``; ``of: value`` — a json output,
    whose text cut already is its value's compact JSON."""

    of: str
    type: str
    parts: tuple[Mapping[str, Any], ...] = ()  # descriptors of the non-text parts (the markers' source)
    kept_text: str | None = None  # of=output, text under the threshold: the joined text, served whole


@dataclass(frozen=True, slots=True)
class TrimPlan:
    lane: Lane
    route: Route
    threshold: int
    cuts: tuple[Cut, ...]
    kind: str = "text"                  # opaque in flight: the output type after trimming (text | error-text)
    skeleton: Any = None                # codec route: the deflated skeleton (the output value itself)
    shape: str | None = None            # opaque at persist: the v1 shape (text | mcp-content)
    extra: Mapping[str, Any] | None = None  # opaque at persist: metadata / blocks for the envelope
    original: Original | None = None    # opaque: the original output kept in the blob store (non-text, json)

    @property
    def text_cut(self) -> Cut | None:
        """The opaque lane's text cut (None when only non-text parts are offloaded)."""
        for c in self.cuts:
            if c.key != ORIGINAL_KEY:
                return c
        return None

    @property
    def output_cut(self) -> Cut | None:
        """The cut of a whole original output (of=output, key ``ORIGINAL_KEY``); None for any other plan."""
        return next((c for c in self.cuts if c.key == ORIGINAL_KEY), None)

    @property
    def original_cut(self) -> Cut | None:
        """The blob holding the original output: its own cut (of=output) or the text cut (of=value)."""
        if self.original is None:
            return None
        return self.text_cut if self.original.of == OF_VALUE else self.output_cut

    @property
    def blobs(self) -> list[Cut]:
        """The distinct texts to write, in order (the same text twice is one blob)."""
        seen: dict[str, Cut] = {}
        for c in self.cuts:
            if c.sha256 is not None and c.sha256 not in seen:
                seen[c.sha256] = c
        return list(seen.values())


@dataclass(frozen=True, slots=True)
class TrimRecord:
    """What happened to one cut after apply (for logs and the truncation reply)."""

    key: str
    mode: Literal["offloaded", "inline"]
    total_chars: int
    total_lines: int
    uri: str | None = None
    sha256: str | None = None
    original: bool = False  # the blob of the original output (key ORIGINAL_KEY), not a trimmed text


def measure(text: str, key: str = "") -> Cut:
    """sha256 of the UTF-8 bytes and the §3 excerpt (default sizes) of a text that will be trimmed.

    The hot path of both lanes: the excerpt is ``excerpt(text)`` inlined, lines are counted on the bytes (with
    numpy for large ones), and a text over 1 MB is hashed on a worker thread (hashlib releases the GIL) while
    this thread counts its lines.
    """
    try:
        data = text.encode()  # UTF-8
    except UnicodeEncodeError:  # lone surrogates: no blob can hold these bytes
        ex = excerpt(text)
        return Cut(key, None, None, text, ex.head, ex.tail, ex.total_lines, ex.total_chars)
    n = len(text)
    if n <= HEAD_CHARS + TAIL_CHARS:  # never trimmed by either lane; measured the general way all the same
        ex = excerpt(text)
        sha = _new_sha256(data).hexdigest()
        return Cut(key, sha, f"{VFS_SCHEME}vfs_{sha[:16]}.txt", text, ex.head, ex.tail, ex.total_lines, n)
    if len(data) >= PARALLEL_MIN_BYTES:
        started = threading.Event()
        fut = _hash_pool().submit(_sha256, data, started)
        started.wait()  # let the worker reach the GIL-free hash before counting lines here
        lines = count_newlines(data) + 1
        sha = fut.result()
    else:
        sha = _new_sha256(data).hexdigest()
        lines = count_newlines(data) + 1
    # == excerpt(text, HEAD_CHARS, TAIL_CHARS) for a text longer than HEAD_CHARS + TAIL_CHARS
    cut = text.rfind("\n", 0, HEAD_CHARS + 1)
    head = text[:cut + 1] if cut >= 0 else text[:HEAD_CHARS]
    nl = text.find("\n", n - TAIL_CHARS)
    tail = text[nl + 1:] if nl >= 0 else text[n - TAIL_CHARS:]
    # tuple.__new__ straight away: the same NamedTuple without a Python-level __new__ frame (hot loop)
    return _tuple_new(Cut, (key, sha, f"{VFS_SCHEME}vfs_{sha[:16]}.txt", text, head, tail, lines, n))


def written_uri(cut: Cut, written: Mapping[str, str | None]) -> str | None:
    """The URI to show for a cut, or None when its write failed (or the store acknowledged other bytes)."""
    if cut.sha256 is None:
        return None
    uri = written.get(cut.sha256)
    return uri if uri == cut.uri else None


def _offloaded_by_ctxbuild(part: Mapping[str, Any], output: Mapping[str, Any]) -> bool:
    """Typed provenance only: an ``offload`` record or a ``persisted`` output. Never inferred from text."""
    return part.get("offload") is not None or output.get("type") == "persisted"


def entity_blobs_to_trim(blobs: Sequence[tuple[str, str]], threshold: int) -> list[tuple[str, str]]:
    """The codec blobs of one output to trim, in key order (both lanes, so a persisted envelope still renders to
    the in-flight bytes at the same threshold).

    Every blob longer than ``max(threshold, head + tail)`` (== ``needs_trim`` for each, SPEC §5.2); then, while
    the blobs together are still longer than ``threshold`` (a trimmed one counted at ``TRIMMED_MAX_CHARS``, an
    upper bound of its marker), the longest of the others longer than ``TRIMMED_MAX_CHARS`` (ties: key order).
    Without the second rule an output of many entities each under the threshold is served whole however long it
    is together (a 13.5k-char web_search of 3 results at a 9.6k threshold, or 10 results of 9k each: 90k chars),
    while the same text as an opaque output would have been trimmed. A trimmed blob (its marker) is never longer
    than ``TRIMMED_MAX_CHARS``, so a trimmed output shown again is left alone (idempotent by content too).
    """
    floor = max(threshold, HEAD_CHARS + TAIL_CHARS)
    chosen = [len(text) > floor for _, text in blobs]
    total = sum(TRIMMED_MAX_CHARS if c else len(text) for c, (_, text) in zip(chosen, blobs, strict=True))
    if total > threshold:
        others = sorted((i for i, (_, text) in enumerate(blobs) if not chosen[i] and len(text) > TRIMMED_MAX_CHARS),
                        key=lambda i: (-len(blobs[i][1]), i))
        for i in others:
            if total <= threshold:
                break
            chosen[i] = True
            total -= len(blobs[i][1]) - TRIMMED_MAX_CHARS
    return [b for b, c in zip(blobs, chosen, strict=True) if c]


# ---------- in-flight lane (§5) ----------

def plan_inflight(part: Mapping[str, Any], threshold: int) -> TrimPlan | None:
    """What to trim in one tool-result part before it is served; None leaves the part exactly as it is."""
    if part.get("type") != "tool-result":
        return None
    output = part.get("output")
    if not isinstance(output, Mapping) or _offloaded_by_ctxbuild(part, output):
        return None
    policy = policy_for(part)
    if not policy.truncatable:
        return None
    kind = output.get("type")
    if policy.codec is not None and kind == "json":
        d = deflate(policy.codec, output.get("value"))
        if d is not None:
            cuts = tuple([measure(text, key) for key, text in entity_blobs_to_trim(d.blobs, threshold)])
            return TrimPlan("inflight", "codec", threshold, cuts, "json", d.skeleton) if cuts else None
    text = extract_text(output)
    if text is None:
        return None
    if kind == "content" and has_nontext(output):
        return _plan_nontext(output, text, "inflight", threshold, threshold)
    if not needs_trim(text, threshold):
        return None
    cut = measure(text)
    original = Original(OF_VALUE, kind) if kind in JSON_TYPES and cut.sha256 is not None else None
    return TrimPlan("inflight", "opaque", threshold, (cut,), "error-text" if kind in ERROR_TYPES else "text",
                    original=original)


def _plan_nontext(output: Mapping[str, Any], text: str, lane: Lane, threshold: int, limit: int) -> TrimPlan | None:
    """A content output with non-text parts: offloaded when its text is over the limit, or when its non-text
    parts are (their JSON, in chars); the original output goes to the blob store whole. None: untouched."""
    trim = needs_trim(text, limit)
    original = original_text(output)
    if not trim and len(original) - len(text) <= limit:
        return None
    ocut = measure(original, ORIGINAL_KEY)
    if ocut.sha256 is None:  # not storable as UTF-8: the text lanes' old behaviour (persist: keep it whole)
        return TrimPlan(lane, "opaque", threshold, (measure(text),)) if trim and lane == "inflight" else None
    cuts = (measure(text), ocut) if trim else (ocut,)
    if any(c.sha256 is None for c in cuts):
        return None
    return TrimPlan(lane, "opaque", threshold, cuts, "text", shape="mcp-content",
                    original=Original(OF_OUTPUT, "content", tuple(describe(output)), None if trim else text))


def _original_record(plan: TrimPlan, uri: str) -> dict[str, Any]:
    o, cut = plan.original, plan.original_cut
    assert o is not None and cut is not None
    rec: dict[str, Any] = {"uri": uri, "sha256": cut.sha256, "totalChars": cut.total_chars, "of": o.of,
                           "type": o.type}
    if o.of == OF_OUTPUT:
        rec["parts"] = [dict(d) for d in o.parts]
    return rec


def _apply_nontext(part: Mapping[str, Any], plan: TrimPlan, written: Mapping[str, str | None]) -> dict[str, Any]:
    """In flight, of=output: the text (or its marker / inline excerpt) and a marker per non-text part. The
    original not written → the part whole: nothing is dropped ("better fat than lost")."""
    o, ocut = plan.original, plan.original_cut
    assert o is not None and ocut is not None
    ouri = written_uri(ocut, written)
    if ouri is None:
        return part if isinstance(part, dict) else dict(part)
    offload: dict[str, Any] = {"mode": "offloaded"}
    cut = plan.text_cut
    if cut is None:
        text = o.kept_text or ""
        offload.update(totalChars=len(text), totalLines=text.count("\n") + 1)
    else:
        uri = written_uri(cut, written)
        if uri is not None:
            text = render_marker(cut.head, cut.tail, cut.total_lines, cut.total_chars, uri)
            offload.update(uri=uri, sha256=cut.sha256)
        else:
            text = inline_truncate(cut.text)
        offload.update(totalChars=cut.total_chars, totalLines=cut.total_lines)
    offload["threshold"] = plan.threshold
    offload["original"] = _original_record(plan, ouri)
    out = dict(part)
    out["output"] = {"type": "text", "value": render_with_markers(text, o.parts, ouri)}
    out["offload"] = offload
    return out


def apply_inflight(part: Mapping[str, Any], plan: TrimPlan, written: Mapping[str, str | None]) -> dict[str, Any]:
    """The trimmed part: marker (written) or inline excerpt (not) for the opaque lane; per-entity markers for a
    codec (an entity whose write failed keeps its full text; nothing written → the part itself)."""
    if plan.route == "opaque":
        if plan.original is not None and plan.original.of == OF_OUTPUT:
            return _apply_nontext(part, plan, written)
        cut = plan.cuts[0]
        uri = written_uri(cut, written)
        out = dict(part)
        if uri is not None:
            value = render_marker(cut.head, cut.tail, cut.total_lines, cut.total_chars, uri)
            offload = {"mode": "offloaded", "uri": uri, "sha256": cut.sha256, "totalChars": cut.total_chars,
                       "totalLines": cut.total_lines, "threshold": plan.threshold}
            if plan.original is not None:  # a json output: the offloaded text is its value's compact JSON
                offload["original"] = _original_record(plan, uri)
        else:
            value = inline_truncate(cut.text)
            offload = {"mode": "inline", "totalChars": cut.total_chars, "totalLines": cut.total_lines,
                       "threshold": plan.threshold}
        out["output"] = {"type": plan.kind, "value": value}
        out["offload"] = offload
        return out
    texts: dict[str, str] = {}
    chars = lines = 0
    get = written.get
    for cut in plan.cuts:
        uri = cut.uri
        if uri is None or get(cut.sha256) != uri:
            continue  # not written: this field keeps its full text
        texts[cut.key] = render_marker(cut.head, cut.tail, cut.total_lines, cut.total_chars, uri)
        chars += cut.total_chars
        lines += cut.total_lines
    if not texts:
        return part if isinstance(part, dict) else dict(part)
    out = dict(part)
    out["output"] = {"type": "json", "value": assemble(plan.skeleton, texts)}
    # one record for the part; totals cover its offloaded fields (each field's own figures are in its marker)
    out["offload"] = {"mode": "offloaded", "totalChars": chars, "totalLines": lines, "threshold": plan.threshold}
    return out


def trim_records(plan: TrimPlan, written: Mapping[str, str | None]) -> list[TrimRecord]:
    """One record per cut that changed the output (in flight: a failed entity write changed nothing)."""
    ocut = plan.output_cut
    if ocut is not None and written_uri(ocut, written) is None and plan.lane == "inflight":
        return []  # the original was not stored: the part stays whole
    out = []
    for cut in plan.cuts:
        uri = written_uri(cut, written)
        if uri is not None:
            out.append(TrimRecord(cut.key, "offloaded", cut.total_chars, cut.total_lines, uri, cut.sha256,
                                  cut is ocut))
        elif plan.route == "opaque" and plan.lane == "inflight" and cut is not ocut:
            out.append(TrimRecord(cut.key, "inline", cut.total_chars, cut.total_lines))
    return out


# ---------- persist lane (§7) ----------

def _content_layout(blocks: Any) -> tuple[bool, list[dict[str, Any]] | None]:
    """(persistable, layout) of an MCP content array: layout None when it is exactly one plain text block."""
    if type(blocks) is not list:
        return False, None
    if len(blocks) == 1 and type(blocks[0]) is dict and list(blocks[0]) == ["type", "text"] \
            and blocks[0]["type"] == "text" and type(blocks[0]["text"]) is str:
        return True, None
    layout = []
    for b in blocks:
        if type(b) is not dict or "type" not in b:
            return False, None
        if b["type"] == "text":
            t = b.get("text")
            if type(t) is not str:
                return False, None  # nothing we could put back exactly: keep the output whole
            nb = dict(b)
            nb["text"] = len(t)
            layout.append(nb)
        else:
            layout.append(b)
    return True, layout


def plan_persist(part: Mapping[str, Any], threshold: int) -> TrimPlan | None:
    """What to offload from one tool-result part before its message is stored; None keeps it whole.

    ``threshold`` is the persist threshold (``persist_threshold(configured)``, absolute); a text is only
    offloaded when longer than both it and 1,500 chars. Error outputs, outputs already offloaded or persisted,
    and structured outputs without a (matching) codec are left alone.
    """
    if part.get("type") != "tool-result":
        return None
    output = part.get("output")
    if not isinstance(output, Mapping) or _offloaded_by_ctxbuild(part, output):
        return None
    kind = output.get("type")
    if kind in ERROR_TYPES:
        return None
    policy = policy_for(part)
    if policy.codec is None and not policy.truncatable:
        return None
    limit = max(threshold, PERSIST_MIN_CHARS)
    if kind == "json":
        if policy.codec is None:
            return None
        d = deflate(policy.codec, output.get("value"))
        if d is None:
            return None
        cuts = tuple([c for c in [measure(text, key) for key, text in entity_blobs_to_trim(d.blobs, limit)]
                      if c.sha256 is not None])
        return TrimPlan("persist", "codec", threshold, cuts, "json", d.skeleton) if cuts else None
    extra: dict[str, Any] = {}
    if kind == "text":
        text, shape = output.get("value"), "text"
        if type(text) is not str:
            return None
    elif kind == "content":
        ok, layout = _content_layout(output.get("value"))
        if not ok:
            return None
        text, shape = "\n".join(content_texts(output["value"])), "mcp-content"
        if isinstance(output.get("metadata"), Mapping):
            extra["metadata"] = output["metadata"]
        if layout is not None:
            extra["blocks"] = layout
    else:
        return None
    if not needs_trim(text, limit):
        return None
    if kind == "content" and has_nontext(output):
        # the original goes to the blob store too; ``extra`` is the envelope should that write fail (today's v1)
        plan = _plan_nontext(output, text, "persist", threshold, limit)
        return None if plan is None else replace(plan, kind=kind, extra=extra)
    cut = measure(text)
    if cut.sha256 is None:
        return None
    return TrimPlan("persist", "opaque", threshold, (cut,), kind, shape=shape, extra=extra)


def _blob_ref_fields(cut: Cut) -> dict[str, Any]:
    sha = cut.sha256
    return {"fileEntryId": sha, "vfsFilename": vfs_handle(sha), "head": cut.head, "tail": cut.tail,
            "totalChars": cut.total_chars, "totalLines": cut.total_lines}


def apply_persist(part: Mapping[str, Any], plan: TrimPlan, written: Mapping[str, str | None]) -> dict[str, Any]:
    """The part to store: a ``persisted`` output holding a v1 or v2 envelope; the part itself when no text of it
    was written (and, for a codec, the full text of each field whose write failed)."""
    if plan.route == "opaque":
        cut = plan.text_cut
        if cut is None or written_uri(cut, written) is None:
            return part if isinstance(part, dict) else dict(part)
        envelope = _blob_ref_fields(cut)
        envelope["shape"] = plan.shape
        ocut = plan.output_cut
        if ocut is not None and written_uri(ocut, written) is not None:
            # every block and the metadata are in the original blob: the event keeps only what markers name
            envelope["original"] = {"fileEntryId": ocut.sha256, "vfsFilename": vfs_handle(ocut.sha256),
                                    "totalChars": ocut.total_chars, "parts": [dict(d) for d in plan.original.parts]}
        elif plan.extra:
            envelope.update(plan.extra)
    else:
        refs = []
        snippets: dict[str, str] = {}
        for cut in plan.cuts:
            if written_uri(cut, written) is None:
                continue
            refs.append({"key": cut.key, **_blob_ref_fields(cut)})
            snippets[cut.key] = snippet(cut.text)
        if not refs:
            return part if isinstance(part, dict) else dict(part)
        envelope = {"shape": "entities", "skeleton": assemble(plan.skeleton, snippets), "blobRefs": refs}
    out = dict(part)
    out["output"] = {"type": "persisted", "value": envelope}
    return out


# ---------- one call per part, for callers with a synchronous store (tests, tools, benchmarks) ----------

def trim_inflight(part: Mapping[str, Any], threshold: int, store: Any = None) -> dict[str, Any]:
    """plan → ``store(blob) -> uri | None`` for each blob → apply. ``store=None`` means no storage (inline)."""
    plan = plan_inflight(part, threshold)
    if plan is None:
        return part if isinstance(part, dict) else dict(part)
    written = {b.sha256: (store(b) if store is not None else None) for b in plan.blobs}
    return apply_inflight(part, plan, written)


def trim_persist(part: Mapping[str, Any], threshold: int, store: Any) -> dict[str, Any]:
    plan = plan_persist(part, threshold)
    if plan is None:
        return part if isinstance(part, dict) else dict(part)
    return apply_persist(part, plan, {b.sha256: store(b) for b in plan.blobs})
