"""web_fetch: one page over HTTP(S) → its readable text as one citable entity.

HTML goes through trafilatura (main text and title; all the page's text when it finds no main content), plain
text and JSON come back as they are, anything else is refused. The body is streamed and cut at ``max_bytes``;
the whole download (redirects included) has one deadline.
"""

from __future__ import annotations

import asyncio

import httpx

from ...domain.web.outputs import WebToolError, entities_output
from ...domain.web.pages import ACCEPT, Page, extract, media_kind, mime_of
from ...domain.web.settings import DEFAULT_USER_AGENT
from .netguard import AddressPolicy, BlockedAddress, GuardedTransport, blocked_reason, validate_url


def make_client(*, allow_private_networks: bool = False, user_agent: str = DEFAULT_USER_AGENT,
                max_redirects: int = 5, address_policy: AddressPolicy = blocked_reason) -> httpx.AsyncClient:
    """The HTTP client of web_fetch. Without private networks every connection goes through the SSRF guard.
    Proxies from the environment are ignored: the guard must see the real target."""
    transport = None if allow_private_networks else GuardedTransport(address_policy)
    return httpx.AsyncClient(transport=transport, trust_env=False, follow_redirects=True,
                             max_redirects=max_redirects, headers={"User-Agent": user_agent, "Accept": ACCEPT})


async def download(client: httpx.AsyncClient, url: httpx.URL, max_bytes: int, timeout: float) -> Page:
    async with client.stream("GET", url, timeout=httpx.Timeout(timeout)) as resp:
        final = str(resp.url.copy_with(fragment=None))
        if resp.status_code >= 400:
            reason = f" {resp.reason_phrase}" if resp.reason_phrase else ""
            raise WebToolError(f"http-{resp.status_code}", f"{final} answered HTTP {resp.status_code}{reason}")
        content_type = resp.headers.get("content-type")
        if mime_of(content_type) is not None and media_kind(content_type, b"") is None:
            # refused on its header alone: an image or a PDF is never read
            raise WebToolError("unsupported-media", f"{final} is {mime_of(content_type)}; web_fetch reads HTML, "
                                                    f"plain text and JSON only")
        chunks: list[bytes] = []
        size, truncated = 0, False
        async for chunk in resp.aiter_bytes():  # decoded (gzip/br): the cap is on what we would have to hold
            if size + len(chunk) > max_bytes:
                chunks.append(chunk[:max_bytes - size])
                size, truncated = max_bytes, True
                break
            chunks.append(chunk)
            size += len(chunk)
        return Page(final, content_type, b"".join(chunks), truncated, max_bytes)


def _failure(exc: BaseException, url: str, timeout: float) -> WebToolError:
    if isinstance(exc, WebToolError):
        return exc
    if isinstance(exc, BlockedAddress):
        return WebToolError("blocked-address", f"{exc}: web_fetch does not reach private networks")
    if isinstance(exc, TimeoutError | httpx.TimeoutException):
        return WebToolError("timeout", f"{url} did not answer in full within {timeout:g}s")
    if isinstance(exc, httpx.TooManyRedirects):
        return WebToolError("too-many-redirects", f"{url}: {exc}")
    if isinstance(exc, httpx.UnsupportedProtocol | httpx.InvalidURL):
        return WebToolError("invalid-url", f"{url}: {exc}")
    return WebToolError("fetch-failed", f"{url}: {str(exc) or type(exc).__name__}")


async def web_fetch(url: str, *, max_bytes: int, timeout: float, client: httpx.AsyncClient | None = None,
                    allow_private_networks: bool = False, user_agent: str = DEFAULT_USER_AGENT,
                    max_redirects: int = 5) -> dict:
    """Fetch one page; its readable text as ``{"type": "json", "value": [{id, title, url, content}]}``, or a
    ``[Error: <code>] …`` error-text. With ``client`` given, that client's guard and headers apply."""
    try:
        target = validate_url(url)
    except WebToolError as exc:
        return exc.output()
    own = client is None
    if own:
        client = make_client(allow_private_networks=allow_private_networks, user_agent=user_agent,
                             max_redirects=max_redirects)
    try:
        async with asyncio.timeout(timeout):  # one deadline for the whole download: a slow drip cannot stall it
            page = await download(client, target, max_bytes, timeout)
        entity = await asyncio.to_thread(extract, page)
    except (WebToolError, BlockedAddress, httpx.HTTPError, httpx.InvalidURL, TimeoutError) as exc:
        return _failure(exc, str(target), timeout).output()
    finally:
        if own:
            await client.aclose()
    return entities_output([entity])
