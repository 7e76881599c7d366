"""A stdio MCP server whose tools answer with outputs of any size and type, for the no-ceiling tests:
``big_json`` (structured JSON of a requested size, sent as text and structuredContent, as the MCP spec asks),
``picture`` (an image block with deterministic PNG bytes beside a caption) and ``big_text``.

Run as ``python -m tests.support.bulky_mcp_server`` (or by path); everything is derived from the arguments, so a
test can rebuild the expected output byte for byte (:func:`records`, :func:`png_bytes`).
"""

from __future__ import annotations

import base64
import json
import struct
import zlib

from mcp.server.mcpserver import MCPServer
from mcp.types import CallToolResult, ImageContent, TextContent

server = MCPServer("bulky")


def records(megabytes: float) -> list[dict]:
    """About ``megabytes`` MB of JSON records (compact), deterministic."""
    out, size, i = [], 0, 0
    while size < megabytes * 1_000_000:
        rec = {"id": i, "name": f"item-{i:07d}", "tags": ["alpha", "beta", f"t{i % 97}"],
               "note": f"record {i} of the bulky catalogue; checksum {(i * 2654435761) % 4294967296:010d}"}
        out.append(rec)
        size += len(json.dumps(rec, separators=(",", ":"))) + 1
        i += 1
    return out


def png_bytes(side: int) -> bytes:
    """A valid ``side``×``side`` RGB PNG with a deterministic gradient (no imaging library needed)."""
    rows = b"".join(b"\x00" + bytes(((x * 7 + y * 3) % 256, (x * y) % 256, (x ^ y) % 256)
                                     [k] for x in range(side) for k in range(3)) for y in range(side))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 9)) + \
        chunk(b"IEND", b"")


def catalogue(megabytes: float) -> dict:
    return {"records": records(megabytes)}


@server.tool(description="Dump the catalogue as JSON records (about `megabytes` MB).")
def big_json(megabytes: float = 1.0) -> CallToolResult:
    data = catalogue(megabytes)
    text = json.dumps(data, separators=(",", ":"))
    return CallToolResult(content=[TextContent(type="text", text=text)], structured_content=data)


@server.tool(description="Render a test picture of the given side in pixels, with a caption.")
def picture(side: int = 64) -> CallToolResult:
    data = base64.b64encode(png_bytes(side)).decode()
    return CallToolResult(content=[TextContent(type="text", text=f"A {side}x{side} gradient."),
                                   ImageContent(type="image", data=data, mimeType="image/png")])


@server.tool(description="A long plain-text report of `lines` numbered lines.")
def big_text(lines: int = 1000) -> str:
    return "".join(f"line {i:08d}: the bulky server reports a steady state\n" for i in range(lines))


if __name__ == "__main__":
    server.run("stdio")
