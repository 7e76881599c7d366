"""Binary detection for stored bytes: fs_read/read_file serve text only."""

from __future__ import annotations

SNIFF_BYTES = 8192


def decode_text(data: bytes) -> str | None:
    """The UTF-8 text, or None when the bytes are not text (invalid UTF-8, or a NUL early on, as git does)."""
    if b"\x00" in data[:SNIFF_BYTES]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None
