"""What web_fetch makes of a downloaded page, pure: the media kind (header or sniffed), the encoding, the readable
text of HTML (trafilatura) or plain text and JSON, as one citable entity. The download is
``adapters/web/fetch.py``."""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass
from typing import Literal

import trafilatura

from .outputs import Entity, WebToolError

MediaKind = Literal["html", "text", "json"]
ACCEPT = "text/html,application/xhtml+xml,text/plain;q=0.9,application/json;q=0.9,text/*;q=0.8,*/*;q=0.1"
SNIFF_BYTES = 4_096
_HTML_TYPES = frozenset({"text/html", "application/xhtml+xml"})
_JSON_TYPES = frozenset({"application/json", "text/json"})
_META_CHARSET = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?\s*([A-Za-z0-9_.:-]+)""", re.IGNORECASE)
_HTML_START = re.compile(r"\s*(<!--.*?-->\s*)*<(!doctype\s+html|html|head|body)\b", re.IGNORECASE | re.DOTALL)
_BLANK_RUNS = re.compile(r"\n{3,}")


@dataclass(frozen=True, slots=True)
class Page:
    """What came over the wire: the final URL (after redirects), its media type and at most max_bytes of body."""

    url: str
    content_type: str | None
    body: bytes
    truncated: bool
    max_bytes: int


def mime_of(content_type: str | None) -> str | None:
    if not content_type:
        return None
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime or None


def charset_of(content_type: str | None) -> str | None:
    """The charset parameter of a Content-Type, if it names a codec Python knows."""
    if not content_type:
        return None
    for param in content_type.split(";")[1:]:
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset":
            return known_codec(value.strip().strip("\"'"))
    return None


def known_codec(name: str | bytes | None) -> str | None:
    if isinstance(name, bytes):
        name = name.decode("ascii", "ignore")
    if not name:
        return None
    try:
        return codecs.lookup(name).name
    except LookupError:
        return None


def sniff(head: bytes) -> MediaKind | None:
    """The kind of an untyped body from its first bytes: None for binary (NUL bytes or not UTF-8)."""
    if b"\x00" in head:
        return None
    try:  # final=False: a multi-byte character cut at the sniff boundary is not a reason to refuse
        text = codecs.getincrementaldecoder("utf-8")("strict").decode(head, final=False)
    except UnicodeDecodeError:
        return None
    if _HTML_START.match(text):
        return "html"
    return "json" if text.lstrip()[:1] in ("{", "[") else "text"


def media_kind(content_type: str | None, head: bytes) -> MediaKind | None:
    """html / text / json for what web_fetch can read; None for anything else (images, PDFs, archives…).
    A missing Content-Type is sniffed from the first bytes."""
    mime = mime_of(content_type)
    if mime is None:
        return sniff(head)
    if mime in _HTML_TYPES:
        return "html"
    if mime in _JSON_TYPES or mime.endswith("+json"):
        return "json"
    if mime.startswith("text/"):
        return "text"
    return None


def decode(body: bytes, encoding: str, truncated: bool, errors: str = "replace") -> str:
    # a cut body may end inside a multi-byte character: an incremental decoder drops that partial tail
    return codecs.getincrementaldecoder(encoding)(errors).decode(body, final=not truncated)


def html_encoding(page: Page) -> str | None:
    """The page's encoding from the header, a <meta charset>, or valid UTF-8; None when it takes a guess."""
    enc = charset_of(page.content_type)
    if enc:
        return enc
    m = _META_CHARSET.search(page.body[:SNIFF_BYTES])
    if m and (enc := known_codec(m.group(1))):
        return enc
    try:
        decode(page.body, "utf-8", page.truncated, "strict")
        return "utf-8"
    except UnicodeDecodeError:
        return None


def tidy(text: str) -> str:
    return _BLANK_RUNS.sub("\n\n", text.replace("\r\n", "\n")).strip()


def extract_html(html: str | bytes, url: str | None = None) -> tuple[str | None, str]:
    """(title, readable text) of an HTML document: trafilatura's main text, or every text node when it finds no
    main content (short pages, link lists)."""
    doc = trafilatura.bare_extraction(html, url=url, include_comments=False, include_links=False,
                                      include_images=False, include_tables=True, with_metadata=True)
    title = (doc.title or None) if doc is not None else None
    text = (doc.text or "") if doc is not None else ""
    if not text.strip():
        text = trafilatura.html2txt(html)
        if title is None and text:
            meta = trafilatura.extract_metadata(html if isinstance(html, str) else decode(html, "utf-8", False))
            title = meta.title if meta is not None else None
    return (title.strip() or None) if title else None, tidy(text)


def truncation_note(page: Page) -> str:
    return (f"\n\n[Truncated: the page is larger than web_fetch reads ({page.max_bytes:,} bytes); this text "
            f"covers only its beginning.]")


def readable(page: Page) -> Entity:
    """The entity of a downloaded page (CPU-bound for HTML: run it off the event loop)."""
    kind = media_kind(page.content_type, page.body[:SNIFF_BYTES])
    if kind is None:
        raise WebToolError("unsupported-media", f"{page.url} is {mime_of(page.content_type) or 'binary data'}; "
                                                f"web_fetch reads HTML, plain text and JSON only")
    title: str | None = None
    if kind == "html":
        enc = html_encoding(page)
        title, text = extract_html(decode(page.body, enc, page.truncated) if enc else page.body, page.url)
    else:
        text = decode(page.body, charset_of(page.content_type) or "utf-8", page.truncated)
        text = text.removeprefix("\ufeff")
    if not text.strip():
        raise WebToolError("empty-content", f"{page.url} has no readable text")
    if page.truncated:
        text += truncation_note(page)  # at the end: the tail is what an in-flight excerpt keeps
    return Entity(title=title or page.url, url=page.url, content=text)


def extract(page: Page) -> Entity:
    """readable(), with a parser failure on a hostile or broken page reported to the model, not raised."""
    try:
        return readable(page)
    except WebToolError:
        raise
    except Exception as exc:  # noqa: BLE001 — lxml/trafilatura on arbitrary bytes: never fail the turn
        raise WebToolError("extraction-failed", f"{page.url}: the page could not be parsed ({exc})") from None


