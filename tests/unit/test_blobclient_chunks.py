"""Blob client helpers (pure): any content becomes bounded byte chunks, in order, without quadratic copying."""

import asyncio
import hashlib

import pytest
from ctxbuild_blobclient import Rechunker, digest_str, pieces, str_slices


async def drain(source, n: int) -> list[bytes]:
    r = Rechunker(pieces(source))
    out = []
    while chunk := await r.next(n):
        assert 0 < len(chunk) <= n
        out.append(chunk)
    assert await r.next(n) == b""  # stays exhausted
    return out


@pytest.mark.parametrize("n", [1, 3, 7, 64, 1000])
async def test_rechunker_reassembles_any_pieces_exactly(n):
    text = "héllo 😀 wörld\n" * 50
    data = text.encode()
    for source in (text, data, bytearray(data), [text[:5], b"", text[5:].encode()],
                   (data[i:i + 11] for i in range(0, len(data), 11))):
        chunks = await drain(source, n)
        assert b"".join(chunks) == data
        assert all(len(c) == n for c in chunks[:-1])  # every chunk but the last is full


async def test_async_iterables_and_mixed_pieces():
    async def gen():
        yield "a"
        await asyncio.sleep(0)
        yield b"b"
        yield memoryview(b"cd")
        yield ""

    assert b"".join(await drain(gen(), 3)) == b"abcd"


async def test_bad_pieces_are_rejected():
    with pytest.raises(TypeError):
        await drain([1, 2], 4)
    with pytest.raises(UnicodeEncodeError):  # a lone surrogate has no UTF-8 form, hence no content address
        await drain(["ok", "\ud800"], 4)


async def test_large_single_piece_is_sliced_not_shifted():
    data = bytes(range(256)) * 40_000  # 10 MB in one piece
    chunks = await drain([data], 512 * 1024)
    assert len(chunks) == 20 and b"".join(chunks) == data


def test_digest_str_hashes_without_one_big_copy():
    text = "x😀" * 300_000
    assert digest_str(text) == (hashlib.sha256(text.encode()).hexdigest(), len(text.encode()))
    assert b"".join(str_slices(text, 1000)) == text.encode()
    assert digest_str("") == (hashlib.sha256(b"").hexdigest(), 0)
