"""An attachment larger than a NATS message goes in through the HTTP edge (claim check) and reads back exactly."""

from __future__ import annotations

import hashlib

import httpx
import pytest

from tests.support.auth import AUTH

pytestmark = pytest.mark.e2e


async def test_three_megabyte_attachment_round_trip(all_services, rpc):
    text = "".join(f"{i:08d} the quick brown fox jumps over the lazy dog\n" for i in range(60_000))  # ~3.2 MB
    async with httpx.AsyncClient(base_url=all_services, headers=AUTH, timeout=120) as http:
        cid = (await http.post("/v1/conversations", json={})).json()["id"]
        r = await http.post(f"/v1/conversations/{cid}/attachments",
                            files={"file": ("big.log", text.encode(), "text/plain")})
        assert r.status_code == 201, r.text
        att = r.json()
        hist = (await http.get(f"/v1/conversations/{cid}/messages")).json()
    assert att["sha256"] == hashlib.sha256(text.encode()).hexdigest() and att["size"] == len(text.encode())
    assert [a["handle"] for a in hist["attachments"]] == ["big.log"]
    offset = len(text) - 5_000
    page = await rpc.call("ctx.blob.read_file", {"conversationId": cid, "filename": "big.log",
                                                 "offset": offset, "limit": 3_000})
    assert page["text"] == text[offset:offset + 3_000] and page["nextOffset"] == offset + 3_000
