"""A local server speaking SearXNG's JSON search API (``GET /search?q=…&format=json``).

Answers come from an index query → results given by the test (each result ``{url, title, content}``); they are
wrapped the way SearXNG sends them (engine, positions, score, category, and the empty answer/infobox lists). A
format other than the enabled ones gets 403, as a real instance does when ``json`` is not in ``search.formats``.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.support.server import ThreadedServer


class FakeSearxng(ThreadedServer):
    def __init__(self, port: int, index: dict[str, list[dict[str, Any]]] | None = None) -> None:
        self.index: dict[str, list[dict[str, Any]]] = dict(index or {})
        self.formats = {"html", "json"}
        self.fail_next: int | None = None  # HTTP status to answer the next request with
        self.requests: list[dict[str, str]] = []
        super().__init__(Starlette(routes=[Route("/search", self.search, methods=["GET", "POST"])]), port)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def search(self, request: Request) -> Response:
        params = dict(request.query_params)
        self.requests.append(params)
        if self.fail_next:
            status, self.fail_next = self.fail_next, None
            return Response(b"Internal Server Error", status_code=status, media_type="text/html")
        fmt = params.get("format", "html")
        if fmt not in self.formats:
            return Response(b"Forbidden", status_code=403, media_type="text/html")
        q = params.get("q", "")
        results = []
        for i, r in enumerate(self.index.get(q, []), start=1):
            parts = urlsplit(r["url"])
            results.append({
                "url": r["url"], "title": r["title"], "content": r["content"], "engine": "duckduckgo",
                "parsed_url": [parts.scheme, parts.netloc, parts.path, "", parts.query, parts.fragment],
                "template": "default.html", "engines": ["duckduckgo", "brave"], "positions": [i, i],
                "score": round(2.0 / i, 4), "category": "general", "publishedDate": None, "thumbnail": "",
            })
        return JSONResponse({"query": q, "number_of_results": 0, "results": results, "answers": [],
                             "corrections": [], "infoboxes": [], "suggestions": [], "unresponsive_engines": []})
