"""A local web server for web_fetch tests: pages registered by path, plus endpoints that misbehave on purpose
(redirect chains, a redirect to anywhere, an answer that never comes, a body that drips).

Every request is recorded (path and headers), so a test can check that a refused fetch never reached it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.support.server import ThreadedServer

# an article page with navigation and a footer around the main text (extraction must keep only the text)
ARTICLE = """<!doctype html><html><head><meta charset="utf-8"><title>Tide pools of Brittany</title></head>
<body><nav><a href="/">Home</a> <a href="/shop">Shop</a> <a href="/login">Log in</a></nav>
<article><h1>Tide pools of Brittany</h1>
<p>At low tide the granite shelves near Roscoff hold hundreds of small pools full of anemones and blennies.</p>
<p>Visitors are asked to put every stone back the way they found it, because the animals live underneath.</p>
<p>The richest pools lie below the mid-tide line and are only uncovered on the biggest spring tides.</p>
<p>Local guides run walks twice a month and explain how the shore changes through the year.</p>
</article>
<footer>Copyright 2024 Example Media. All rights reserved. Cookie settings.</footer></body></html>"""
GIVE_UP_S = 60  # the slow endpoints stop on their own after this, should a client never hang up


@dataclass
class Page:
    body: bytes
    content_type: str | None
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)


class PageServer(ThreadedServer):
    def __init__(self, port: int) -> None:
        self.pages: dict[str, Page] = {}
        self.requests: list[tuple[str, dict[str, str]]] = []
        super().__init__(Starlette(routes=[
            Route("/redirect/{n:int}", self.redirect),
            Route("/goto", self.goto),
            Route("/slow", self.slow),
            Route("/drip", self.drip),
            Route("/{path:path}", self.page),
        ]), port)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}/{path.lstrip('/')}"

    def add(self, path: str, body: bytes | str, content_type: str | None, status: int = 200,
            headers: dict[str, str] | None = None) -> str:
        data = body.encode() if isinstance(body, str) else body
        self.pages["/" + path.lstrip("/")] = Page(data, content_type, status, headers or {})
        return self.url(path)

    def seen(self, path: str) -> bool:
        return any(p == path for p, _ in self.requests)

    def _record(self, request: Request) -> None:
        self.requests.append((request.url.path, dict(request.headers)))

    async def page(self, request: Request) -> Response:
        self._record(request)
        page = self.pages.get(request.url.path)
        if page is None:
            return Response(b"not found", status_code=404, media_type="text/plain")
        headers = dict(page.headers)
        if page.content_type is not None:
            headers["content-type"] = page.content_type
        # Response(media_type=None) sends no Content-Type at all: what an untyped answer looks like
        return Response(page.body, status_code=page.status, headers=headers)

    async def redirect(self, request: Request) -> Response:
        """/redirect/n → /redirect/n-1 → … → /redirect/0 → /article.html (n+1 redirects)."""
        self._record(request)
        n = request.path_params["n"]
        return RedirectResponse(f"/redirect/{n - 1}" if n > 0 else "/article.html", status_code=302)

    async def goto(self, request: Request) -> Response:
        self._record(request)
        return RedirectResponse(request.query_params["u"], status_code=302)

    async def slow(self, request: Request) -> Response:
        """Never answers while the client waits; returns as soon as it hangs up."""
        self._record(request)
        for _ in range(GIVE_UP_S * 20):
            if await request.is_disconnected():
                break
            await asyncio.sleep(0.05)
        return Response(b"too late", media_type="text/plain")

    async def drip(self, request: Request) -> Response:
        """Headers at once, then one byte every 0.1 s: each read is quick, the whole body never ends in time."""
        self._record(request)

        async def body():
            for _ in range(GIVE_UP_S * 10):
                yield b"."
                await asyncio.sleep(0.1)

        return StreamingResponse(body(), media_type="text/plain")
