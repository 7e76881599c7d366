"""The context inspector: pages under ``/ui`` that show what the model saw, step by step (issue #20).

Behind the API's own keys: ``POST /ui/login`` verifies a key with the edge's :class:`Authenticator` and sets it in
an HttpOnly, SameSite=Strict cookie scoped to ``/ui`` (Secure over https); every ``/ui`` page and endpoint
verifies the cookie's key again (the authenticator's cache, revocation within ``CTX_AUTH_CACHE_S``). The ``/v1``
API never reads the cookie. Another tenant's conversation is 404, as in the API. Read-only: nothing here writes.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path as FsPath
from typing import Annotated, Any
from urllib.parse import quote, urlencode

import structlog
from ctxbuild_platform.errors import RemoteError, ServiceError
from fastapi import APIRouter, Form, HTTPException, Path, Query, Request
from fastapi.responses import (
    FileResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from fastapi.templating import Jinja2Templates
from sse_starlette import EventSourceResponse

from ..adapters.auth import Authenticator
from ..app.edge import Edge
from ..domain.keys import Principal
from . import render
from .index import ConversationIndex
from .timeline import (
    TERMINAL,
    VFS_URI,
    conversation_view,
    path_to,
    preview,
    request_diff,
    tree_rows,
    turn_timeline,
    uris_in,
)

log = structlog.get_logger("inspector")

HERE = FsPath(__file__).parent
COOKIE = "ctx_ui_key"
COOKIE_MAX_AGE_S = 12 * 3600
ID_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.:-]*$"  # the API's path ids
Id = Annotated[str, Path(max_length=128, pattern=ID_PATTERN)]
STATIC = {"inspector.css": "text/css", "inspector.js": "text/javascript",
          "chart.umd.min.js": "text/javascript"}
STATIC_PATHS = {"chart.umd.min.js": HERE / "static" / "vendor" / "chartjs" / "chart.umd.min.js"}
READ_BACK_MAX_BYTES = 4 * 1024 * 1024  # shown on the page; the raw link streams the whole blob
REQUEST_CACHE = 512  # served requests kept parsed (content-addressed: never stale)


class NeedLogin(Exception):
    pass


class NotFound(Exception):
    pass


def script_json(value: Any) -> str:
    """JSON safe inside a <script> element (no ``</script>``, no HTML comment openers)."""
    return (json.dumps(value, ensure_ascii=False).replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("&", "\\u0026"))


def _message(exc: Exception) -> str:
    return exc.message if isinstance(exc, ServiceError) else (str(exc) or "not found")


def _fmt(n: Any) -> str:
    return f"{n:,}" if isinstance(n, int) else ("—" if n is None else str(n))


def build_inspector(edge: Edge, auth: Authenticator, *, trace_ui_url: str | None = None,
                    sse_poll_s: float = 0.3) -> APIRouter:
    """The /ui router over the edge's own use cases (tenant checks, turn reads, the SSE event stream, the
    results read-back) — nothing here decides ownership differently from the API."""
    backends = edge.backends
    ui = APIRouter(prefix="/ui", include_in_schema=False)
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    templates.env.filters["n"] = _fmt
    templates.env.globals["quote"] = lambda s: quote(str(s), safe="")
    index = ConversationIndex(backends.rpc)
    requests_cache: OrderedDict[str, Any] = OrderedDict()

    # ---------- who ----------
    async def principal(request: Request) -> Principal:
        key = request.cookies.get(COOKIE)
        if not key:
            raise NeedLogin()
        try:
            who = await auth.authenticate(key)
        except HTTPException as exc:
            if exc.status_code == 401:
                raise NeedLogin() from exc
            raise
        await auth.check_rate(who)
        return who

    def page(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
        """An HTML page: no valid cookie → the login page (then back here); not found / not the tenant's → 404."""

        @functools.wraps(handler)
        async def wrapped(request: Request, *args: Any, **kwargs: Any) -> Response:
            try:
                return await handler(request, *args, **kwargs)
            except NeedLogin:
                target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
                return RedirectResponse(f"/ui/login?{urlencode({'next': target})}", status_code=303)
            except (NotFound, ServiceError) as exc:
                if isinstance(exc, ServiceError) and exc.code != "not-found":
                    raise
                return templates.TemplateResponse(request, "error.html", {
                    "who": None, "title": "Not found", "message": _message(exc)}, status_code=404)

        return wrapped

    def api(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        """A JSON/SSE endpoint of the pages: 401 / 404 in the API's error shape."""

        @functools.wraps(handler)
        async def wrapped(request: Request, *args: Any, **kwargs: Any) -> Any:
            try:
                return await handler(request, *args, **kwargs)
            except NeedLogin:
                return JSONResponse({"code": "unauthenticated", "message": "log in at /ui/login",
                                     "retryable": False}, status_code=401)
            except (NotFound, ServiceError) as exc:
                if isinstance(exc, ServiceError) and exc.code != "not-found":
                    raise
                return JSONResponse({"code": "not-found", "message": _message(exc), "retryable": False},
                                    status_code=404)

        return wrapped

    # ---------- records, checked against the tenant ----------
    async def conversation_events(cid: str, who: Principal) -> list[dict[str, Any]]:
        """The conversation's stream, if it is the caller's tenant's (the API's check: else the same 404)."""
        await edge.conversation_settings(cid, who)
        return await backends.read_stream_all(f"conversation:{cid}")

    async def turn_events(cid: str, tid: str, who: Principal) -> list[dict[str, Any]]:
        """A turn of the caller's conversation, its events as a client reads them (the API's turn log)."""
        return (await edge.turn_log(who, cid, tid))["events"]

    async def served_request(cid: str, served: dict[str, Any]) -> Any:
        ref = served.get("request")
        if not ref:
            return None
        if "body" in ref:  # a small request is kept in the event itself
            return json.loads(ref["body"])
        sha = ref["sha256"]
        if sha in requests_cache:
            requests_cache.move_to_end(sha)
            return requests_cache[sha]
        body = json.loads(await backends.blobs.get_bytes(cid, sha256=sha))
        requests_cache[sha] = body
        while len(requests_cache) > REQUEST_CACHE:
            requests_cache.popitem(last=False)
        return body

    async def turn_status(tid: str) -> dict[str, Any]:
        last, ev = await edge.stream_tail(f"turn:{tid}")
        if not last or ev is None:
            return {"status": "admitted"}
        t = ev.get("type")
        status = ("completed" if t == "TurnCompleted" else "failed" if t == "TurnFailed"
                  else "queued" if t == "TurnQueued" else "running")
        out = {"status": status, "events": last}
        if t in TERMINAL:
            out.update({k: ev["data"].get(k) for k in ("steps", "code", "message") if k in ev["data"]})
        return out

    async def timeline(cid: str, tid: str, who: Principal) -> tuple[dict[str, Any], dict[str, Any], list]:
        view = conversation_view(await conversation_events(cid, who))
        events = await turn_events(cid, tid, who)
        cmd = events[0]["data"]
        served = [e["data"] for e in events if e["type"] == "StepServed"]
        bodies = await asyncio.gather(*(served_request(cid, s) for s in served), return_exceptions=True)
        requests = {s["step"]: (b if not isinstance(b, BaseException) else None)
                    for s, b in zip(served, bodies, strict=True)}
        before = path_to(view, cmd.get("userMessageId"))
        tl = turn_timeline(events, cmd.get("settings") or view["settings"], before, requests)
        tl.update(turnId=tid, conversationId=cid, userMessageId=cmd.get("userMessageId"),
                  provider=(cmd.get("provider") or {}).get("kind"), regenerateOf=cmd.get("regenerateOf"))
        return tl, view, events

    def read_link(cid: str) -> Callable[[str], str]:
        return lambda uri: f"/ui/conversations/{quote(cid)}/read?{urlencode({'uri': uri})}"

    def trace_link(trace_id: str | None) -> str | None:
        if not trace_id or not trace_ui_url:
            return None
        return trace_ui_url.replace("{trace_id}", trace_id)

    def ctx(who: Principal | None, **extra: Any) -> dict[str, Any]:
        return {"who": who, **extra}

    # ---------- login ----------
    @ui.get("/")
    async def home() -> Response:
        return RedirectResponse("/ui/conversations", status_code=303)

    def safe_next(target: str | None) -> str:
        if target and target.startswith("/ui/") and not target.startswith("//") and "\\" not in target:
            return target
        return "/ui/conversations"

    @ui.get("/login")
    async def login_form(request: Request, next: str | None = None) -> Response:
        return templates.TemplateResponse(request, "login.html", ctx(None, next=safe_next(next), error=None))

    @ui.post("/login")
    async def login(request: Request, key: Annotated[str, Form(max_length=512)],
                    next: Annotated[str | None, Form(max_length=2048)] = None) -> Response:
        key = key.strip()
        try:
            who = await auth.authenticate(key)
        except HTTPException as exc:
            status = exc.status_code if exc.status_code in (401, 429) else 401
            return templates.TemplateResponse(request, "login.html", ctx(
                None, next=safe_next(next), error="That key was not accepted." if status == 401
                else "Too many attempts; try again in a moment."), status_code=status)
        log.info("ui-login", subject=who.subject, tenant=who.tenant)
        resp = RedirectResponse(safe_next(next), status_code=303)
        https = request.url.scheme == "https" or request.headers.get("x-forwarded-proto") == "https"
        resp.set_cookie(COOKIE, key, max_age=COOKIE_MAX_AGE_S, path="/ui", httponly=True, samesite="strict",
                        secure=https)
        return resp

    @ui.post("/logout")
    async def logout() -> Response:
        resp = RedirectResponse("/ui/login", status_code=303)
        resp.delete_cookie(COOKIE, path="/ui")
        return resp

    @ui.get("/static/{name}")
    async def static(name: str) -> Response:
        if name not in STATIC:
            return Response(status_code=404)
        path = STATIC_PATHS.get(name, HERE / "static" / name)
        return FileResponse(path, media_type=STATIC[name], headers={"Cache-Control": "no-cache"})

    # ---------- pages ----------
    @ui.get("/conversations")
    @page
    async def conversations(request: Request) -> Response:
        who = await principal(request)
        entries = await index.of_tenant(who.tenant)
        return templates.TemplateResponse(request, "conversations.html", ctx(who, entries=entries))

    @ui.get("/conversations/{cid}")
    @page
    async def conversation(request: Request, cid: Id) -> Response:
        who = await principal(request)
        view = conversation_view(await conversation_events(cid, who))
        admissions = await backends.read_stream_all(f"conversation-turns:{cid}")
        turns = []
        statuses = await asyncio.gather(*(turn_status(a["data"]["turnId"]) for a in admissions))
        for a, st in zip(admissions, statuses, strict=True):
            user = view["messages"].get(a["data"]["userMessageId"])
            turns.append({"turnId": a["data"]["turnId"], "userMessageId": a["data"]["userMessageId"],
                          "regenerateOf": a["data"].get("regenerateOf"), "admittedAt": a.get("recordedAt"),
                          "text": preview(user) if user else "", **st})
        # the current path: to the newest message (the anchor every new turn writes to)
        newest = view["order"][-1] if view["order"] else None
        current = {m["id"] for m in path_to(view, newest)}
        rows = tree_rows(view, current)
        for r in rows:
            r["preview"] = preview(r["message"])
            s = view["summaries"].get(r["message"]["id"])
            r["summary"] = s
        return templates.TemplateResponse(request, "conversation.html", ctx(
            who, cid=cid, view=view, turns=turns, rows=rows, link=read_link(cid),
            branches=sum(1 for r in rows if r["siblings"] > 1)))

    @ui.get("/conversations/{cid}/turns/{tid}")
    @page
    async def turn(request: Request, cid: Id, tid: Id) -> Response:
        who = await principal(request)
        tl, view, _ = await timeline(cid, tid, who)
        user = view["messages"].get(tl["userMessageId"])
        return templates.TemplateResponse(request, "turn.html", ctx(
            who, cid=cid, tid=tid, tl=tl, title=view["title"], task=preview(user, 400) if user else "",
            timeline_json=script_json(tl)))

    @ui.get("/conversations/{cid}/turns/{tid}/steps/{step}")
    @page
    async def step_page(request: Request, cid: Id, tid: Id,
                        step: Annotated[int, Path(ge=0, le=1_000_000)]) -> Response:
        who = await principal(request)
        tl, view, events = await timeline(cid, tid, who)
        row = next((r for r in tl["steps"] if r["step"] == step), None)
        if row is None:
            raise NotFound(f"turn {tid} has no step {step}")
        served = {e["data"]["step"]: e["data"] for e in events if e["type"] == "StepServed"}
        req = await served_request(cid, served[step])
        prev_steps = [k for k in served if k < step]
        prev = await served_request(cid, served[max(prev_steps)]) if prev_steps else None
        link = read_link(cid)
        messages = []
        if req is not None:
            for item in request_diff(prev, req):
                m = item["message"]
                mid = str(m.get("id", ""))
                summary = mid.startswith("compaction:")
                parts = [render.part_view(p, link) for p in m.get("parts") or []]
                if not mid.startswith("compaction:") and m.get("role") == "tool":
                    for p in parts:
                        if p.get("toolCallId"):
                            p["resultLink"] = (f"/ui/conversations/{quote(cid)}/results/{quote(mid)}/"
                                               f"{quote(str(p['toolCallId']))}")
                messages.append({**item, "id": mid, "role": m.get("role"), "parts": parts, "summary": summary,
                                 "transcripts": uris_in(json.dumps(m, ensure_ascii=False)) if summary else [],
                                 "trimmed": render.has_trim_marker(m)})
        # compactions of this step: an in-loop fold's summary is the request's summary row; a turn-start fold's
        # is the stored CompactionSummaryRecorded at its boundary. Its archive: the transcript(s) it names.
        compactions = []
        for mk in row["markers"]:
            if not mk["kind"].startswith("compaction"):
                continue
            stored = view["summaries"].get(mk.get("boundaryId")) or {}
            text = stored.get("summary")
            if text is None and req is not None:
                row_msg = next((m for m in req.get("messages") or [] if str(m.get("id", "")).startswith(
                    "compaction:")), None)
                text = "\n".join(p.get("text") or "" for p in (row_msg or {}).get("parts") or [])
            text = text or ""
            last_line = text.rstrip().rsplit("\n", 1)[-1]
            archives = uris_in(last_line) if "transcript" in last_line else []
            compactions.append({"marker": mk, "summary": render.linkify(text, link),
                                "archives": archives or list(mk.get("uris") or [])[-3:]})
        return templates.TemplateResponse(request, "step.html", ctx(
            who, cid=cid, tid=tid, row=row, tl=tl, req=req, messages=messages, compactions=compactions,
            pretty=render.pretty(req) if req is not None else None, link=link,
            trace_url=trace_link(row.get("traceId")), prev_step=max(prev_steps) if prev_steps else None,
            next_step=min((k for k in served if k > step), default=None),
            system_html=render.linkify(str(req.get("system") or ""), link) if req else None,
            tool_names=[t.get("name") for t in (req or {}).get("tools") or []]))

    @ui.get("/conversations/{cid}/turns/{tid}/steps/{step}/request.json")
    @page
    async def step_request_raw(request: Request, cid: Id, tid: Id,
                               step: Annotated[int, Path(ge=0, le=1_000_000)]) -> Response:
        who = await principal(request)
        body, request_hash = await edge.served_request(who, cid, tid, step)
        return Response(body, media_type="application/json", headers={"X-Request-Hash": request_hash})

    @ui.get("/conversations/{cid}/read")
    @page
    async def read_back(request: Request, cid: Id, uri: Annotated[str, Query(max_length=200)],
                        raw: bool = False) -> Response:
        """An archived output or a compaction transcript in full, by its URI (the blob store checks the
        conversation references it)."""
        who = await principal(request)
        await conversation_events(cid, who)
        if not VFS_URI.fullmatch(uri):
            raise NotFound(f"not an archive URI: {uri}")
        try:
            if raw:
                async def body():
                    async for piece in backends.blobs.iter_text(cid, uri=uri):
                        yield piece.encode()
                return StreamingResponse(body(), media_type="text/plain; charset=utf-8")
            data = await backends.blobs.get_bytes(cid, uri=uri, length=READ_BACK_MAX_BYTES + 1)
        except RemoteError as exc:
            if exc.code in ("not-found", "access-denied"):
                raise NotFound(f"{uri} is not readable in conversation {cid}") from exc
            raise
        cut = len(data) > READ_BACK_MAX_BYTES
        text = data[:READ_BACK_MAX_BYTES].decode("utf-8", "replace")
        return templates.TemplateResponse(request, "readback.html", ctx(
            who, cid=cid, heading=uri, text=render.linkify(text, read_link(cid)), cut=cut, chars=len(text),
            raw_link=f"/ui/conversations/{quote(cid)}/read?{urlencode({'uri': uri, 'raw': 'true'})}",
            source="archived blob, read back from the blob store"))

    @ui.get("/conversations/{cid}/results/{mid}/{call_id}")
    @page
    async def result_back(request: Request, cid: Id, mid: Id, call_id: Id) -> Response:
        """A stored tool result in full (the API's results read-back)."""
        who = await principal(request)
        full = await edge.tool_result(who, cid, mid, call_id)  # a running turn's results: once it is stored
        out = full["output"]
        value = out.get("value")
        text = value if isinstance(value, str) else render.pretty(value)
        return templates.TemplateResponse(request, "readback.html", ctx(
            who, cid=cid, heading=f"tool result {call_id}", text=render.linkify(text, read_link(cid)),
            cut=False, chars=len(text), raw_link=None, source=f"tool result read back ({full['source']})"))

    @ui.get("/conversations/{cid}/attachments/{sha256}")
    @page
    async def attachment_back(request: Request, cid: Id,
                              sha256: Annotated[str, Path(pattern=r"^[0-9a-f]{64}$")]) -> Response:
        who = await principal(request)
        view = conversation_view(await conversation_events(cid, who))
        att = next((a for a in view["attachments"] if a.get("sha256") == sha256), None)
        if att is None:
            raise NotFound("no such attachment")
        data = await backends.blobs.get_bytes(cid, sha256=sha256, length=READ_BACK_MAX_BYTES + 1)
        text = data[:READ_BACK_MAX_BYTES].decode("utf-8", "replace")
        return templates.TemplateResponse(request, "readback.html", ctx(
            who, cid=cid, heading=f"attachment {att.get('handle')}", text=render.linkify(text, read_link(cid)),
            cut=len(data) > READ_BACK_MAX_BYTES, chars=len(text), raw_link=None, source=att.get("mediaType")))

    # ---------- JSON + live ----------
    @ui.get("/api/conversations/{cid}/turns/{tid}/timeline")
    @api
    async def timeline_json(request: Request, cid: Id, tid: Id) -> Any:
        who = await principal(request)
        tl, _, _ = await timeline(cid, tid, who)
        return JSONResponse(tl)

    @ui.get("/api/conversations/{cid}/turns/{tid}/events")
    @api
    async def live_events(request: Request, cid: Id, tid: Id) -> Any:
        """The turn's events as SSE (as ``GET /v1/…/events``, without the text deltas), for EventSource with
        the cookie: the page refreshes its chart and steps as they come, and stops at the terminal event."""
        who = await principal(request)
        last = request.headers.get("last-event-id") or ""
        start = int(last) + 1 if last.isdigit() else 1
        st, _ = await edge.turn_state(cid, tid, who)
        if st.done and start > st.version:
            return Response(status_code=204)  # ended and fully seen: EventSource stops reconnecting
        # the API's own SSE stream of the turn (GET /v1/…/events), without the text deltas
        return EventSourceResponse(edge.event_stream(cid, tid, st, start, False, sse_poll_s,
                                                     request.is_disconnected), ping=5)

    return ui


__all__ = ["COOKIE", "ServiceError", "build_inspector"]
