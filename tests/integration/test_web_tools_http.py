"""web_fetch and web_search over real HTTP, against local servers on 127.0.0.1 (tests/support/web_pages.py and
tests/support/fake_searxng.py): content types, redirects, errors, deadlines, the size cap, the SSRF guard on
every hop, and the WebTools facade the runner holds."""

from __future__ import annotations

import gzip
import ipaddress
import re

import pytest
from ctxbuild_devstack import free_port
from ctxbuild_orchestration.adapters.web import (
    SearxngBackend,
    WebTools,
    WebToolSettings,
    blocked_reason,
    make_client,
    web_fetch,
    web_search,
)

from tests.support.fake_searxng import FakeSearxng
from tests.support.web_pages import ARTICLE, PageServer

pytestmark = pytest.mark.integration

ID = re.compile(r"^[A-Za-z0-9]{8}-1$")
MAX = 65_536
PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000") + b"\x00" * 32
BIG_TEXT = "".join(f"line {i:06d} of a long plain text body\n" for i in range(10_000))  # ~370 KB


@pytest.fixture(scope="module")
def site():
    s = PageServer(free_port()).start()
    s.add("article.html", ARTICLE, "text/html; charset=utf-8")
    s.add("plain.txt", "na\u00efve caf\u00e9 \u2713\nsecond line\n", "text/plain; charset=utf-8")
    s.add("latin1.txt", "cr\u00e8me br\u00fbl\u00e9e".encode("latin-1"), "text/plain; charset=iso-8859-1")
    s.add("data.json", '{"name": "tide", "pools": [1, 2, 3]}', "application/json")
    s.add("image.png", PNG, "image/png")
    s.add("paper.pdf", b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<<>>\nendobj\n", "application/pdf")
    s.add("untyped.bin", b"\x00\x01\x02\x03" * 64, None)
    s.add("untyped.html", ARTICLE, None)
    s.add("links.html", "<html><head><title>Index</title></head><body><ul><li><a href='/a'>Alpha</a></li>"
                        "<li><a href='/b'>Beta</a></li></ul></body></html>", "text/html")
    s.add("empty.html", "<html><head></head><body></body></html>", "text/html")
    s.add("boom", "oops", "text/plain", status=500)
    s.add("gone", "gone", "text/plain", status=410)
    s.add("big.txt", BIG_TEXT, "text/plain; charset=utf-8")
    s.add("big.gz.txt", gzip.compress(BIG_TEXT.encode()), "text/plain; charset=utf-8",
          headers={"content-encoding": "gzip"})
    s.add("big-utf8.txt", "\u00e9t\u00e9 \u2713 " * 40_000, "text/plain; charset=utf-8")
    s.add("to-file", b"", "text/plain", status=302, headers={"location": "file:///etc/passwd"})
    yield s
    s.stop()


async def fetch(url: str, **kw) -> dict:
    kw.setdefault("max_bytes", MAX)
    kw.setdefault("timeout", 10.0)
    kw.setdefault("allow_private_networks", True)  # the pages are on 127.0.0.1
    return await web_fetch(url, **kw)


def only(out: dict) -> dict:
    assert out["type"] == "json", out
    [item] = out["value"]
    assert list(item) == ["id", "title", "url", "content"] and ID.match(item["id"])
    return item


async def test_html_page_becomes_its_readable_text(site):
    item = only(await fetch(site.url("article.html#top")))
    assert item["title"] == "Tide pools of Brittany"
    assert item["url"] == site.url("article.html")
    assert "granite shelves near Roscoff" in item["content"] and "Log in" not in item["content"]
    assert "Copyright" not in item["content"]
    path, headers = site.requests[-1]
    assert path == "/article.html" and headers["user-agent"].startswith("ctxbuild-web/")
    assert "text/html" in headers["accept"]


async def test_untyped_html_is_sniffed_and_link_pages_fall_back_to_all_text(site):
    assert only(await fetch(site.url("untyped.html")))["title"] == "Tide pools of Brittany"
    links = only(await fetch(site.url("links.html")))
    assert "Alpha" in links["content"] and "Beta" in links["content"] and links["title"] == "Index"


async def test_text_and_json_come_back_as_they_are(site):
    assert only(await fetch(site.url("plain.txt")))["content"] == "na\u00efve caf\u00e9 \u2713\nsecond line\n"
    assert only(await fetch(site.url("latin1.txt")))["content"] == "cr\u00e8me br\u00fbl\u00e9e"
    item = only(await fetch(site.url("data.json")))
    assert item["content"] == '{"name": "tide", "pools": [1, 2, 3]}' and item["title"] == site.url("data.json")


@pytest.mark.parametrize("path,what", [("image.png", "image/png"), ("paper.pdf", "application/pdf"),
                                       ("untyped.bin", "binary data")])
async def test_binaries_are_refused(site, path, what):
    out = await fetch(site.url(path))
    assert out == {"type": "error-text", "value": f"[Error: unsupported-media] {site.url(path)} is {what}; "
                                                  f"web_fetch reads HTML, plain text and JSON only"}


async def test_a_page_without_text_is_an_error(site):
    assert (await fetch(site.url("empty.html")))["value"].startswith("[Error: empty-content] ")


async def test_redirects_are_followed_up_to_the_limit(site):
    item = only(await fetch(site.url("redirect/3")))
    assert item["url"] == site.url("article.html") and item["title"] == "Tide pools of Brittany"
    out = await fetch(site.url("redirect/9"), max_redirects=5)
    assert out["value"].startswith("[Error: too-many-redirects] ")
    out = await fetch(site.url("to-file"))
    assert out["value"].startswith("[Error: invalid-url] ")


@pytest.mark.parametrize("path,code", [("missing-page", "http-404"), ("gone", "http-410"), ("boom", "http-500")])
async def test_http_errors_carry_the_status(site, path, code):
    out = await fetch(site.url(path))
    status = code.removeprefix("http-")
    assert out["type"] == "error-text"
    assert out["value"].startswith(f"[Error: {code}] {site.url(path)} answered HTTP {status}")


async def test_no_answer_and_a_dripping_body_both_time_out(site):
    out = await fetch(site.url("slow"), timeout=0.5)
    assert out == {"type": "error-text",
                   "value": f"[Error: timeout] {site.url('slow')} did not answer in full within 0.5s"}
    # each byte arrives well within the read timeout: only the whole-download deadline stops it
    out = await fetch(site.url("drip"), timeout=1.0)
    assert out["value"].startswith("[Error: timeout] ")


async def test_connection_refused_is_fetch_failed():
    out = await fetch(f"http://127.0.0.1:{free_port()}/x")
    assert out["value"].startswith("[Error: fetch-failed] ")


async def test_oversize_body_is_cut_at_the_cap_and_says_so(site):
    item = only(await fetch(site.url("big.txt")))
    body, note = item["content"].split("\n\n[Truncated: ")
    assert BIG_TEXT.startswith(body) and len(body.encode()) == MAX
    assert note == "the page is larger than web_fetch reads (65,536 bytes); this text covers only its beginning.]"
    # the cap applies to the decoded body: a gzip page 30x smaller on the wire is cut at the same place
    gz = only(await fetch(site.url("big.gz.txt")))
    assert gz["content"] == item["content"].replace(site.url("big.txt"), site.url("big.gz.txt"))
    utf8 = only(await fetch(site.url("big-utf8.txt")))
    assert "\ufffd" not in utf8["content"] and "[Truncated: " in utf8["content"]
    assert len(utf8["content"].split("\n\n[Truncated: ")[0].encode()) in range(MAX - 3, MAX + 1)


async def test_small_enough_body_is_not_marked(site):
    item = only(await fetch(site.url("big.txt"), max_bytes=len(BIG_TEXT)))
    assert item["content"] == BIG_TEXT


# ---------- the SSRF guard ----------

async def test_private_targets_are_refused_by_default(site):
    before = len(site.requests)
    for host, reason in [("127.0.0.1", "127.0.0.1 is a loopback address"),
                         ("localhost", "localhost resolves to 127.0.0.1, a loopback address")]:
        out = await web_fetch(site.url("plain.txt", host=host), max_bytes=MAX, timeout=5)
        assert out == {"type": "error-text", "value": f"[Error: blocked-address] {reason}: web_fetch does not "
                                                      f"reach private networks"}
    assert len(site.requests) == before  # refused before connecting: the server never saw them


async def test_every_redirect_hop_goes_through_the_guard(site):
    # a policy that lets 127.0.0.1 through and refuses 127.0.0.2 stands in for public → private
    def policy(ip):
        return "private" if ip == ipaddress.ip_address("127.0.0.2") else None

    async with make_client(address_policy=policy) as client:
        ok = only(await web_fetch(site.url("plain.txt"), max_bytes=MAX, timeout=5, client=client))
        assert ok["content"].startswith("na\u00efve")  # a fetch through the guarded transport
        hop = f"{site.url('goto')}?u=http://127.0.0.2:{site.port}/plain.txt"
        out = await web_fetch(hop, max_bytes=MAX, timeout=5, client=client)
    assert out["value"] == ("[Error: blocked-address] 127.0.0.2 is a private address: web_fetch does not reach "
                            "private networks")
    assert blocked_reason(ipaddress.ip_address("127.0.0.2")) == "loopback"  # the default refuses it anyway


# ---------- web_search against SearXNG's JSON API ----------

HITS = [{"url": f"https://pools.example/{i}", "title": f"Pool {i}", "content": f"snippet {i}"} for i in range(1, 8)]


@pytest.fixture(scope="module")
def searx():
    s = FakeSearxng(free_port(), {"tide pools": HITS}).start()
    yield s
    s.stop()


async def test_searxng_results_become_entities(searx):
    backend = SearxngBackend(searx.base_url)
    out = await web_search("tide pools", backend=backend, max_results=5)
    assert out["type"] == "json"
    assert [(i["title"], i["url"], i["content"]) for i in out["value"]] == \
        [(h["title"], h["url"], h["content"]) for h in HITS[:5]]
    prefix = out["value"][0]["id"].split("-")[0]
    assert [i["id"] for i in out["value"]] == [f"{prefix}-{n}" for n in range(1, 6)]
    assert searx.requests[-1] == {"q": "tide pools", "format": "json"}
    assert (await web_search("nothing here", backend=backend, max_results=5)) == {"type": "json", "value": []}
    await backend.aclose()


async def test_searxng_failures_are_typed(searx):
    backend = SearxngBackend(searx.base_url)
    searx.formats = {"html"}
    try:
        out = await web_search("tide pools", backend=backend, max_results=5)
    finally:
        searx.formats = {"html", "json"}
    assert out["value"] == ("[Error: http-403] SearXNG answered HTTP 403 (is 'json' in search.formats of its "
                            "settings.yml?)")
    searx.fail_next = 502
    assert (await web_search("tide pools", backend=backend, max_results=5))["value"].startswith("[Error: http-502]")
    await backend.aclose()
    down = SearxngBackend(f"http://127.0.0.1:{free_port()}")
    assert (await web_search("q", backend=down, max_results=5))["value"].startswith(
        "[Error: search-failed] SearXNG unreachable: ")
    await down.aclose()


async def test_facade_runs_both_tools(site, searx):
    tools = WebTools(WebToolSettings(searxng_url=searx.base_url, allow_private_networks=True, fetch_max_bytes=MAX))
    try:
        assert [s.name for s in tools.specs()] == ["web_fetch", "web_search"]
        found = await tools.execute("web_search", {"query": "tide pools", "maxResults": 2})
        assert [i["url"] for i in found["value"]] == [HITS[0]["url"], HITS[1]["url"]]
        page = only(await tools.execute("web_fetch", {"url": site.url("article.html")}))
        assert page["title"] == "Tide pools of Brittany"
        again = only(await tools.execute("web_fetch", {"url": site.url("big.txt")}))
        assert "[Truncated: " in again["content"]  # the settings' cap
    finally:
        await tools.aclose()
    guarded = WebTools(WebToolSettings())  # default settings: the guard is on
    try:
        out = await guarded.execute("web_fetch", {"url": site.url("article.html")})
        assert out["value"].startswith("[Error: blocked-address] 127.0.0.1 is a loopback address")
    finally:
        await guarded.aclose()
