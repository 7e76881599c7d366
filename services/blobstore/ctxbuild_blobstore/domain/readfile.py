"""read_file (SPEC §6): a character page of an attachment, by its per-conversation handle."""

from __future__ import annotations

from typing import Any


def read_file_error(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}, "modelText": f"[Error: {code}] {message}"}


def read_file_page(text: str, offset: int = 0, limit: int = 8000) -> dict[str, Any]:
    """Chars are code points, so a surrogate pair is never split; limit ≥ 1 makes every call advance."""
    total = len(text)
    if offset > total or (offset == total and total > 0):
        valid = f"; use 0..{total - 1}" if total else ""
        return read_file_error("offset-out-of-range",
                               f"offset {offset} is past the end of the file ({total} chars){valid}")
    page = text[offset: offset + max(1, limit)]
    nxt = offset + len(page)
    out: dict[str, Any] = {"text": page, "totalChars": total, "modelText": page}
    if nxt < total:
        out["nextOffset"] = nxt
        out["modelText"] = (page + f"\n\n[Showing {len(page)} of {total} chars. "
                                   f"Call read_file again with offset={nxt} for more.]")
    return out
