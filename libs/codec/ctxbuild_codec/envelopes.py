"""Persisted-output envelopes (SPEC §7): parse, render back to the model, inflate for read-back.

- v1 (single blob; shapes ``text``, ``mcp-content``): ``{fileEntryId, vfsFilename, head, tail, totalChars,
  totalLines, shape, metadata?, blocks?, original?}``; ``original`` (SPEC §15.1) names a second blob, the whole
  original output of an ``mcp-content`` with non-text parts, and the descriptors of those parts' markers.
- v2 (``shape: entities``): ``{shape, skeleton, blobRefs: [{key, fileEntryId, vfsFilename, head, tail,
  totalChars, totalLines}]}``; the skeleton holds ``snippet(text)`` at each key.

The JSON Schemas in ``contracts/envelopes/`` are the source of truth; the models in
:mod:`ctxbuild_codec.models.envelopes` are generated from them (``libs/codec/codegen.py``).

``render(envelope)`` gives exactly the output the in-flight lane produced for the same text (a ``text`` marker
for v1, the ``json`` value with per-field markers for v2). ``inflate(envelope, texts)`` gives the original
output back from the blob texts (keyed by ``fileEntryId``); a gone blob degrades to its stored excerpt.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping
from typing import Any

from pydantic import ValidationError

from .codecs import assemble
from .models.envelopes.envelope import PersistedOutput
from .models.envelopes.v1 import PersistedOutputV1
from .models.envelopes.v2 import PersistedOutputV2
from .nontext import OF_OUTPUT, read_back, render_with_markers
from .trim import VFS_SCHEME, degraded_excerpt, render_marker, vfs_handle

__all__ = ["EnvelopeError", "PersistedOutput", "PersistedOutputV1", "PersistedOutputV2", "blob_ids", "blob_refs",
           "inflate", "parse", "render", "render_part", "version"]


class EnvelopeError(ValueError):
    """A persisted value that is not a valid envelope (never raised for a missing blob)."""


def version(envelope: Mapping[str, Any]) -> int:
    return 2 if "blobRefs" in envelope else 1


def parse(envelope: Mapping[str, Any]) -> PersistedOutputV1 | PersistedOutputV2:
    """Validate against the generated models (+ vfsFilename == handle of fileEntryId); EnvelopeError if not."""
    try:
        model = PersistedOutput.model_validate(envelope).root
    except ValidationError as exc:
        raise EnvelopeError(f"not a persisted-output envelope: {exc.errors()[0]['msg']}") from exc
    refs = [model] if isinstance(model, PersistedOutputV1) else model.blobRefs
    if isinstance(model, PersistedOutputV1) and model.original is not None:
        refs = [*refs, model.original]
    for r in refs:
        if r.vfsFilename != vfs_handle(r.fileEntryId):
            raise EnvelopeError(f"vfsFilename {r.vfsFilename} does not name blob {r.fileEntryId}")
    return model


def blob_refs(envelope: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every blob of an envelope as ``{key, fileEntryId, vfsFilename, head, tail, totalChars, totalLines}``
    (v1 → one ref with key ``""``): what references, allow-lists and read-back iterate over."""
    parse(envelope)
    if version(envelope) == 2:
        return [dict(r) for r in envelope["blobRefs"]]
    return [{"key": "", **{k: envelope[k] for k in ("fileEntryId", "vfsFilename", "head", "tail", "totalChars",
                                                   "totalLines")}}]


def blob_ids(envelope: Mapping[str, Any]) -> list[str]:
    """Every blob an envelope names (text blobs, then the original output's), without repeats: what read-back
    fetches and what a message's references must cover."""
    ids = [r["fileEntryId"] for r in blob_refs(envelope)]
    original = envelope.get("original") if version(envelope) == 1 else None
    if original is not None:
        ids.append(original["fileEntryId"])
    return list(dict.fromkeys(ids))


def _original_uri(original: Mapping[str, Any], gone: Collection[str]) -> str | None:
    return None if original["fileEntryId"] in gone else VFS_SCHEME + original["vfsFilename"]


def _marker(ref: Mapping[str, Any], gone: Collection[str]) -> str:
    uri = None if ref["fileEntryId"] in gone else VFS_SCHEME + ref["vfsFilename"]
    return render_marker(ref["head"], ref["tail"], ref["totalLines"], ref["totalChars"], uri)


def render(envelope: Mapping[str, Any], gone: Collection[str] = ()) -> dict[str, Any]:
    """The output the model sees for a persisted envelope: byte-identical to the in-flight lane's output.

    ``gone``: fileEntryIds known to be deleted; their markers carry no URI (never an exception).
    """
    parse(envelope)
    if version(envelope) == 1:
        original = envelope.get("original")
        if original is not None:  # the in-flight lane's text marker + one marker per non-text part
            return {"type": "text", "value": render_with_markers(_marker(envelope, gone), original["parts"],
                                                                  _original_uri(original, gone))}
        return {"type": "text", "value": _marker(envelope, gone)}
    texts = {r["key"]: _marker(r, gone) for r in envelope["blobRefs"]}
    return {"type": "json", "value": assemble(envelope["skeleton"], texts)}


def render_part(part: Mapping[str, Any], gone: Collection[str] = ()) -> dict[str, Any]:
    """A stored tool-result part as served: a ``persisted`` output rendered, with typed ``offload`` provenance
    (as the in-flight lane sets it); any other part unchanged."""
    output = part.get("output") or {}
    if output.get("type") != "persisted":
        return part if isinstance(part, dict) else dict(part)
    envelope = output["value"]
    out = dict(part)
    out["output"] = render(envelope, gone)
    refs = blob_refs(envelope)
    if len(refs) == 1 and refs[0]["key"] == "" and refs[0]["fileEntryId"] not in gone:
        r = refs[0]
        out["offload"] = {"mode": "offloaded", "uri": VFS_SCHEME + r["vfsFilename"], "sha256": r["fileEntryId"],
                          "totalChars": r["totalChars"], "totalLines": r["totalLines"]}
        original = envelope.get("original") if version(envelope) == 1 else None
        if original is not None and original["fileEntryId"] not in gone:
            out["offload"]["original"] = {"uri": VFS_SCHEME + original["vfsFilename"],
                                          "sha256": original["fileEntryId"], "totalChars": original["totalChars"],
                                          "of": OF_OUTPUT, "type": "content", "parts": original["parts"]}
    else:
        out["offload"] = {"mode": "offloaded", "totalChars": sum(r["totalChars"] for r in refs),
                          "totalLines": sum(r["totalLines"] for r in refs)}
    return out


def _verified(text: str, sha256: str) -> bool:
    try:
        return hashlib.sha256(text.encode("utf-8")).hexdigest() == sha256
    except UnicodeEncodeError:
        return False


def _text_for(ref: Mapping[str, Any], texts: Mapping[str, str | None], verify: bool) -> str:
    text = texts.get(ref["fileEntryId"])
    if text is not None and verify and not _verified(text, ref["fileEntryId"]):
        text = None  # other bytes under this id: never served as the output
    return degraded_excerpt(ref["head"], ref["tail"]) if text is None else text


def _inflate_content(full: str, layout: list[dict[str, Any]] | None, degraded: bool) -> list[dict[str, Any]]:
    if layout is None:
        return [{"type": "text", "text": full}]
    if degraded:  # the block boundaries are in the lost text: one text block with the excerpt, media as stored
        return [{"type": "text", "text": full}] + [b for b in layout if b.get("type") != "text"]
    blocks = []
    pos = 0
    for b in layout:
        if b.get("type") == "text" and type(b.get("text")) is int:
            n = b["text"]
            nb = dict(b)
            nb["text"] = full[pos:pos + n] if n else ""
            if n:
                pos += n + 1
            blocks.append(nb)
        else:
            blocks.append(b)
    if pos - 1 != len(full) and not (pos == 0 and full == ""):
        raise EnvelopeError("mcp-content block lengths do not add up to the stored text")
    return blocks


def inflate(envelope: Mapping[str, Any], texts: Mapping[str, str | None], *, verify: bool = True) -> dict[str, Any]:
    """The original output from the blob texts (``texts[fileEntryId]``; None or missing = gone → degraded to
    ``head + "\\n\\n[persisted output no longer available — showing excerpt of N chars]\\n\\n" + tail``).

    With ``verify`` a text whose sha256 is not its fileEntryId counts as gone.
    """
    parse(envelope)
    if version(envelope) == 2:
        full = {r["key"]: _text_for(r, texts, verify) for r in envelope["blobRefs"]}
        return {"type": "json", "value": assemble(envelope["skeleton"], full)}
    original = envelope.get("original")
    if original is not None:
        whole = texts.get(original["fileEntryId"])
        if whole is not None and (not verify or _verified(whole, original["fileEntryId"])):
            return read_back(OF_OUTPUT, "content", whole)  # every block and the metadata, exactly as received
    text = _text_for(envelope, texts, verify)
    if envelope["shape"] == "text":
        return {"type": "text", "value": text}
    degraded = texts.get(envelope["fileEntryId"]) is None or text is not texts.get(envelope["fileEntryId"])
    out: dict[str, Any] = {"type": "content",
                           "value": _inflate_content(text, envelope.get("blocks"), degraded)}
    if "metadata" in envelope:
        out["metadata"] = envelope["metadata"]
    return out
