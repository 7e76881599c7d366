"""The pure parts of the web tools: URL checks, SSRF classification, media handling and readable text, result
mapping (SearXNG and MCP outputs), output shapes, argument checks and which tools a deployment offers."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re

import jsonschema
import pytest
from ctxbuild_codec import deflate
from ctxbuild_orchestration.adapters.web import (
    WEB_FETCH,
    WEB_SEARCH,
    Entity,
    McpSearchBackend,
    Page,
    WebToolError,
    WebTools,
    WebToolSettings,
    available_web_tools,
    blocked_reason,
    entities_from_output,
    entities_output,
    error_output,
    extract_html,
    media_kind,
    readable,
    searxng_entities,
    validate_url,
    web_search,
)
from ctxbuild_orchestration.domain.web.pages import charset_of, sniff
from ctxbuild_orchestration.domain.web.results import entities_from_labelled_text
from ctxbuild_orchestration.domain.web.specs import _check_args
from ctxbuild_platform.settings import ServiceSettings

from tests.support.web_pages import ARTICLE

ID = re.compile(r"^[A-Za-z0-9]{8}-(\d+)$")



# ---------- URLs and the SSRF classification ----------

@pytest.mark.parametrize("url,expected", [
    ("https://example.org/a?b=1", "https://example.org/a?b=1"),
    ("  http://example.org/x#frag  ", "http://example.org/x"),
    ("http://[2606:4700::1]:8080/", "http://[2606:4700::1]:8080/"),
])
def test_valid_urls(url, expected):
    assert str(validate_url(url)) == expected


@pytest.mark.parametrize("url", [
    "", "   ", None, 42, "ftp://example.org/f", "file:///etc/passwd", "javascript:alert(1)", "/relative/path",
    "example.org/no-scheme", "http://", "http://exa mple.org/", "http://example.org/\nHost: x",
    "https://example.org/" + "a" * 9_000, "gopher://example.org:70/",
])
def test_invalid_urls_are_a_typed_error(url):
    with pytest.raises(WebToolError) as err:
        validate_url(url)
    assert err.value.code == "invalid-url"
    assert err.value.output()["value"].startswith("[Error: invalid-url] ")


@pytest.mark.parametrize("ip,reason", [
    ("127.0.0.1", "loopback"), ("127.8.9.10", "loopback"), ("::1", "loopback"),
    ("10.1.2.3", "private"), ("172.16.5.4", "private"), ("192.168.1.1", "private"), ("fc00::1", "private"),
    ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),  # the cloud metadata endpoint
    ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ("100.64.0.1", "shared (carrier-grade NAT)"), ("224.0.0.1", "multicast"), ("ff02::1", "multicast"),
    ("240.0.0.1", "reserved"), ("198.18.0.1", "private"), ("192.0.2.1", "private"),
])
def test_non_public_addresses_are_refused(ip, reason):
    assert blocked_reason(ipaddress.ip_address(ip)) == reason


@pytest.mark.parametrize("ip,inner", [
    ("::ffff:127.0.0.1", "loopback"), ("::ffff:10.0.0.1", "private"), ("2002:7f00:1::", "loopback"),
    ("64:ff9b::a9fe:a9fe", "link-local"),
])
def test_ipv4_inside_ipv6_is_judged_by_the_ipv4_it_reaches(ip, inner):
    assert blocked_reason(ipaddress.ip_address(ip)).startswith(inner + ", embedded in ")


@pytest.mark.parametrize("ip", ["8.8.8.8", "93.184.216.34", "1.1.1.1", "2606:4700:4700::1111",
                                "::ffff:8.8.8.8", "64:ff9b::808:808"])
def test_public_addresses_pass(ip):
    assert blocked_reason(ipaddress.ip_address(ip)) is None


# ---------- media types and readable text ----------

@pytest.mark.parametrize("content_type,kind", [
    ("text/html; charset=utf-8", "html"), ("application/xhtml+xml", "html"), ("TEXT/HTML", "html"),
    ("text/plain", "text"), ("text/markdown; charset=utf-8", "text"), ("text/csv", "text"),
    ("application/json", "json"), ("application/ld+json", "json"), ("application/problem+json", "json"),
    ("image/png", None), ("application/pdf", None), ("application/octet-stream", None), ("video/mp4", None),
    ("application/zip", None),
])
def test_media_kind_by_header(content_type, kind):
    assert media_kind(content_type, b"whatever") == kind


@pytest.mark.parametrize("head,kind", [
    (b"<!DOCTYPE html><html><body>x</body></html>", "html"), (b"  <!-- c --> <html lang=en>", "html"),
    (b'{"a": 1}', "json"), (b"[1, 2]", "json"), (b"just words", "text"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", None), (b"%PDF-1.7\n\xe2\xe3\xcf\xd3", None),
    ("caf\u00e9".encode()[:-1], "text"),  # a character cut at the sniff boundary is not binary
])
def test_untyped_bodies_are_sniffed(head, kind):
    assert sniff(head) == kind
    assert media_kind(None, head) == kind


def test_charset_parameter():
    assert charset_of("text/plain; charset=ISO-8859-1") == "iso8859-1"
    assert charset_of('text/html; charset="utf-8"') == "utf-8"
    assert charset_of("text/plain; charset=no-such-codec") is None
    assert charset_of("text/plain") is None and charset_of(None) is None


def test_html_main_text_without_boilerplate():
    title, text = extract_html(ARTICLE, "https://example.org/pools")
    assert title == "Tide pools of Brittany"
    assert "granite shelves near Roscoff" in text and "shore changes through the year" in text
    assert "Copyright" not in text and "Log in" not in text


def test_html_without_main_content_falls_back_to_all_text():
    html = "<html><head><title>Links</title></head><body><ul><li><a href='/a'>Alpha</a></li>" \
           "<li><a href='/b'>Beta</a></li></ul></body></html>"
    title, text = extract_html(html)
    assert title == "Links"
    assert "Alpha" in text and "Beta" in text


def page(body: bytes | str, content_type: str | None, truncated: bool = False, max_bytes: int = 10_000) -> Page:
    return Page("https://example.org/p", content_type, body.encode() if isinstance(body, str) else body,
                truncated, max_bytes)


def test_readable_entities_per_kind():
    html = readable(page(ARTICLE, "text/html"))
    assert html.title == "Tide pools of Brittany" and html.url == "https://example.org/p"
    text = readable(page("line one\nline two\n", "text/plain; charset=utf-8"))
    assert text.content == "line one\nline two\n" and text.title == "https://example.org/p"
    raw = '{"b": [1, 2], "a": "\u00e9"}'
    assert readable(page(raw, "application/json")).content == raw  # JSON as it came, not re-serialised
    assert readable(page("caf\u00e9".encode("latin-1"), "text/plain; charset=iso-8859-1")).content == "caf\u00e9"
    assert readable(page("\ufeffwith bom", "text/plain")).content == "with bom"


def test_html_encoding_from_meta_when_the_header_has_none():
    doc = '<html><head><meta charset="windows-1252"><title>Caf\u00e9</title></head><body><article>' + \
          "<p>Cr\u00e8me br\u00fbl\u00e9e is served every day at the caf\u00e9 on the corner of the square.</p>" * 5 + \
          "</article></body></html>"
    e = readable(page(doc.encode("cp1252"), "text/html"))
    assert "Cr\u00e8me br\u00fbl\u00e9e" in e.content and e.title == "Caf\u00e9"


def test_truncated_body_says_so_and_drops_a_cut_character():
    body = ("\u00e9t\u00e9 " * 100).encode()[:151]  # ends inside a two-byte character
    e = readable(page(body, "text/plain; charset=utf-8", truncated=True, max_bytes=151))
    assert "\ufffd" not in e.content
    assert e.content.endswith("bytes); this text covers only its beginning.]")
    assert "(151 bytes)" in e.content


@pytest.mark.parametrize("body,ctype,code", [
    (b"\x89PNG\r\n\x1a\n\x00\x00", "image/png", "unsupported-media"),
    (b"\x00\x01\x02binary", None, "unsupported-media"),
    (b"<html><body></body></html>", "text/html", "empty-content"),
    (b"   \n ", "text/plain", "empty-content"),
])
def test_unreadable_pages_are_typed_errors(body, ctype, code):
    with pytest.raises(WebToolError) as err:
        readable(page(body, ctype))
    assert err.value.code == code


# ---------- output shapes ----------

def test_entities_output_shape_and_ids():
    out = entities_output([Entity("A", "https://a.example/", "alpha"), Entity("B", "https://b.example/", "beta")])
    assert out["type"] == "json"
    assert [list(item) for item in out["value"]] == [["id", "title", "url", "content"]] * 2
    numbers = [int(ID.match(item["id"]).group(1)) for item in out["value"]]
    assert numbers == [1, 2]
    assert len({item["id"].split("-")[0] for item in out["value"]}) == 1
    again = entities_output([Entity("A", "https://a.example/", "alpha")])
    assert again["value"][0]["id"].split("-")[0] != out["value"][0]["id"].split("-")[0]  # fresh per call
    d = deflate("entities", out["value"])  # the shape the entities codec splits
    assert [b.key for b in d.blobs] == ["/0/content", "/1/content"]


def test_error_output_shape():
    assert error_output("http-404", "gone") == {"type": "error-text", "value": "[Error: http-404] gone"}


# ---------- search result mapping ----------

def test_searxng_results_mapping():
    data = {"query": "q", "results": [
        {"url": "https://a.example/", "title": "A", "content": "alpha", "engine": "brave", "score": 2.0},
        {"url": "https://b.example/", "title": "", "engine": "ddg"},   # no title, no content
        {"title": "no url"}, "junk",
    ], "answers": [], "infoboxes": []}
    assert searxng_entities(data) == [Entity("A", "https://a.example/", "alpha"),
                                      Entity("https://b.example/", "https://b.example/", "")]
    with pytest.raises(WebToolError) as err:
        searxng_entities({"error": "nope"})
    assert err.value.code == "search-failed"


TAVILY_TEXT = """Detailed Results:

Title: GROM (missile)
URL: https://en.wikipedia.org/wiki/GROM_(missile)
Content: GROM is a Polish man-portable air-defense system.
It was developed by Mesko.
Raw Content: full page text

Title: Piorun
URL: https://en.wikipedia.org/wiki/Piorun
Content: Piorun is a further development of GROM."""


def test_labelled_text_records():
    got = entities_from_labelled_text(TAVILY_TEXT)
    assert [(e.title, e.url) for e in got] == [("GROM (missile)", "https://en.wikipedia.org/wiki/GROM_(missile)"),
                                               ("Piorun", "https://en.wikipedia.org/wiki/Piorun")]
    assert got[0].content.startswith("GROM is a Polish man-portable air-defense system.\nIt was developed by Mesko.")
    assert got[1].content == "Piorun is a further development of GROM."


def test_mcp_outputs_to_results():
    hits = [{"title": "A", "url": "https://a.example/", "content": "alpha"},
            {"name": "B", "link": "https://b.example/", "snippet": "beta"}]
    expected = [Entity("A", "https://a.example/", "alpha"), Entity("B", "https://b.example/", "beta")]
    as_text = {"type": "content", "value": [{"type": "text", "text": json.dumps({"results": hits})}]}
    structured = {"type": "content", "value": [{"type": "text", "text": "2 results"}],
                  "metadata": {"structuredContent": {"web": {"results": hits}}}}
    as_json = {"type": "json", "value": hits}
    for output in (as_text, structured, as_json):
        assert entities_from_output(output, "q") == expected
    tavily = {"type": "content", "value": [{"type": "text", "text": TAVILY_TEXT}]}
    assert [e.url for e in entities_from_output(tavily, "q")][1] == "https://en.wikipedia.org/wiki/Piorun"
    prose = {"type": "text", "value": "The answer is 42, according to several sources."}
    assert entities_from_output(prose, "meaning") == [
        Entity("Search results for 'meaning'", "", "The answer is 42, according to several sources.")]
    assert entities_from_output({"type": "content", "value": []}, "q") == []
    with pytest.raises(WebToolError) as err:
        entities_from_output({"type": "error-text", "value": "rate limited"}, "q")
    assert err.value.code == "search-failed" and "rate limited" in err.value.message


async def test_mcp_backend_calls_the_tool_and_maps_failures():
    calls = []

    async def invoke(tool_id, args):  # answers as ctx.mcp.invoke does: {output: <tool output>}
        calls.append((tool_id, args))
        return {"output": {"type": "content", "value": [{"type": "text", "text": TAVILY_TEXT}]}}

    backend = McpSearchBackend(invoke, "mcp__tavily__tavily_search", "query", max_results_arg="max_results",
                               extra_args={"search_depth": "basic"})
    out = await web_search("grom", backend=backend, max_results=1)
    assert calls == [("mcp__tavily__tavily_search", {"search_depth": "basic", "query": "grom", "max_results": 1})]
    assert [i["title"] for i in out["value"]] == ["GROM (missile)"] and ID.match(out["value"][0]["id"])

    class RemoteError(Exception):
        code, remote_message = "not-found", "no tool mcp__x__y"

    async def missing(tool_id, args):
        raise RemoteError()

    out = await web_search("q", backend=McpSearchBackend(missing, "mcp__x__y"), max_results=3)
    assert out == {"type": "error-text", "value": "[Error: search-failed] mcp__x__y: not-found: no tool mcp__x__y"}

    async def never(tool_id, args):
        await asyncio.Event().wait()

    out = await web_search("q", backend=McpSearchBackend(never, "mcp__x__y", timeout=0.05), max_results=3)
    assert out["value"].startswith("[Error: timeout] mcp__x__y did not answer")


# ---------- arguments, specs and availability ----------

@pytest.mark.parametrize("spec,args,ok", [
    (WEB_FETCH, {"url": "https://example.org"}, True),
    (WEB_FETCH, {}, False),
    (WEB_FETCH, {"url": 3}, False),
    (WEB_FETCH, {"url": "https://example.org", "headers": {}}, False),
    (WEB_FETCH, ["https://example.org"], False),
    (WEB_SEARCH, {"query": "tide pools"}, True),
    (WEB_SEARCH, {"query": "tide pools", "maxResults": 20}, True),
    (WEB_SEARCH, {"query": ""}, False),
    (WEB_SEARCH, {"query": "x" * 501}, False),
    (WEB_SEARCH, {"query": "q", "maxResults": 0}, False),
    (WEB_SEARCH, {"query": "q", "maxResults": 21}, False),
    (WEB_SEARCH, {"query": "q", "maxResults": True}, False),
    (WEB_SEARCH, {"query": "q", "maxResults": "5"}, False),
    (WEB_SEARCH, {"q": "tide pools"}, False),
])
def test_argument_checks_agree_with_the_json_schema(spec, args, ok):
    jsonschema.Draft202012Validator.check_schema(spec.input_schema)
    assert spec.input_schema["additionalProperties"] is False
    assert jsonschema.Draft202012Validator(spec.input_schema).is_valid(args) is ok
    if ok:
        assert _check_args(args, spec.input_schema) == args
    else:
        with pytest.raises(WebToolError) as err:
            _check_args(args, spec.input_schema)
        assert err.value.code == "invalid-input"


def test_which_tools_are_offered():
    plain = WebToolSettings()
    assert available_web_tools(plain) == ["web_fetch"]
    assert available_web_tools(plain, mcp_invoke_available=True) == ["web_fetch"]
    assert available_web_tools(WebToolSettings(searxng_url="http://searx:8080")) == ["web_fetch", "web_search"]
    mcp = WebToolSettings(search_mcp_tool="mcp__tavily__tavily_search")
    assert available_web_tools(mcp) == ["web_fetch"]  # no catalog to call it through
    assert available_web_tools(mcp, mcp_invoke_available=True) == ["web_fetch", "web_search"]
    assert available_web_tools(WebToolSettings(web_fetch_enabled=False)) == []


async def test_facade_offers_and_dispatches():
    async def invoke(tool_id, args):
        return {"type": "json", "value": [{"title": "T", "url": "https://t.example/", "content": args["query"]}]}

    assert [s.name for s in WebTools(WebToolSettings()).specs()] == ["web_fetch"]
    tools = WebTools(WebToolSettings(search_mcp_tool="mcp__s__search"), mcp_invoke=invoke)
    assert [s.name for s in tools.specs()] == ["web_fetch", "web_search"]
    assert await tools.execute("read_file", {"filename": "x"}) is None  # not a web tool: the runner's business
    out = await tools.execute("web_search", {"query": "  tide  "})
    assert out["value"][0]["content"] == "tide" and ID.match(out["value"][0]["id"])
    bad = await tools.execute("web_search", {"query": "tide", "lang": "fr"})
    assert bad["type"] == "error-text" and bad["value"].startswith("[Error: invalid-input] unknown argument")
    assert (await tools.execute("web_fetch", {"url": "mailto:x@example.org"}))["value"].startswith(
        "[Error: invalid-url]")
    off = WebTools(WebToolSettings())
    assert (await off.execute("web_search", {"query": "q"}))["value"].startswith("[Error: unavailable]")
    await tools.aclose()


def test_settings_mix_into_the_service_settings(monkeypatch):
    class Settings(ServiceSettings, WebToolSettings):
        service_name: str = "orchestration"

    monkeypatch.setenv("CTX_NATS_URL", "nats://127.0.0.1:4222")
    monkeypatch.setenv("CTX_SEARXNG_URL", "http://searx.internal:8080")
    monkeypatch.setenv("CTX_FETCH_MAX_BYTES", "1048576")
    s = Settings()
    assert s.searxng_url == "http://searx.internal:8080" and s.fetch_max_bytes == 1_048_576
    assert s.allow_private_networks is False and s.fetch_timeout_s == 20.0
    assert available_web_tools(s) == ["web_fetch", "web_search"]
