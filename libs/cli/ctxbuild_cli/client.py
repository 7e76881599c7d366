"""A small typed client for the orchestration HTTP/SSE API. Every failure leaves as one of two typed errors:
`ApiError` (the server answered 4xx/5xx) or `ConnectionFailed` (it could not be reached or stopped answering)."""

from __future__ import annotations

import codecs
import json
import mimetypes
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self
from urllib.parse import quote

import httpx
from httpx_sse import SSEError, connect_sse

DEFAULT_URL = "http://127.0.0.1:8080"
STACK_ENV_KEY = "CTX_ORCHESTRATION_HTTP"  # written by ctxbuild_devstack into <stack dir>/stack.env
TERMINAL = frozenset({"TurnCompleted", "TurnFailed"})


class CliError(Exception):
    """Base of the client's typed errors."""


class ApiError(CliError):
    """The server answered with an error status; `code`/`message`/`retryable` come from its JSON error body."""

    def __init__(self, status: int, code: str, message: str, retryable: bool = False,
                 method: str = "", path: str = "") -> None:
        super().__init__(f"{method} {path} → HTTP {status} {code}: {message}".strip())
        self.status, self.code, self.message, self.retryable = status, code, message, retryable
        self.method, self.path = method, path

    @property
    def endpoint_missing(self) -> bool:
        """The server does not have this route at all (an older server), as opposed to a missing resource."""
        return self.status == 405 or (self.status == 404 and self.code == "http-404")


class ConnectionFailed(CliError):
    """The orchestration service could not be reached (or the stream kept dropping)."""


@dataclass(frozen=True)
class Event:
    """One turn event from the SSE stream: `id` is the event's version on the turn stream."""

    type: str
    id: int
    data: dict[str, Any]

    @property
    def terminal(self) -> bool:
        return self.type in TERMINAL

    def as_dict(self) -> dict[str, Any]:
        return {"type": self.type, "version": self.id, "data": self.data}


@dataclass(frozen=True)
class ServedRequest:
    """The exact request a model saw on one step: the body as sent by the server and its parsed JSON."""

    raw: bytes
    doc: dict[str, Any]


def stack_env(stack_dir: Path, name: str) -> str | None:
    """A setting a local stack (`make up`) wrote to <stack dir>/stack.env, if there is one."""
    env_file = stack_dir / "stack.env"
    if not env_file.is_file():
        return None
    for line in env_file.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == name and value.strip():
            return value.strip()
    return None


def stack_url(stack_dir: Path) -> str | None:
    """The orchestration URL a local stack (`make up`) wrote, if there is one."""
    return stack_env(stack_dir, STACK_ENV_KEY)


def resolve_url(flag: str | None, stack_dir: Path) -> str:
    """--url / CTXBUILD_URL (typer fills `flag` from either) > the local stack's stack.env > the default."""
    return (flag or stack_url(stack_dir) or DEFAULT_URL).rstrip("/")


def stack_api_key(stack_dir: Path) -> str | None:
    """The local stack's API key (`make up` writes <stack dir>/api-key, mode 0600), if there is one."""
    path = stack_dir / "api-key"
    return (path.read_text().strip() or None) if path.is_file() else None


def stack_admin_key(stack_dir: Path) -> str | None:
    """The local stack's bootstrap admin key (CTX_ADMIN_API_KEY in <stack dir>/stack.env), if there is one."""
    return stack_env(stack_dir, "CTX_ADMIN_API_KEY")


def resolve_api_key(flag: str | None, stack_dir: Path) -> str | None:
    """--api-key / CTXBUILD_API_KEY (typer fills `flag` from either) > the local stack's <dir>/api-key."""
    return flag or stack_api_key(stack_dir)


def guess_media_type(path: Path) -> str:
    """By extension; an unknown extension is text/plain when the head decodes as UTF-8 (logs, notes, code)."""
    guessed, _ = mimetypes.guess_type(path.name)
    if guessed:
        return guessed
    with path.open("rb") as fh:
        head = fh.read(8192)
    try:
        # incremental: a multi-byte character cut at the 8 KiB edge is still text
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return "application/octet-stream"
    return "application/octet-stream" if b"\x00" in head else "text/plain"


def _seg(value: str) -> str:
    """An id as one path segment: a stray `/` or `?` in user input must not address another route."""
    return quote(value, safe="")


def error_from_response(response: httpx.Response) -> ApiError:
    """The server's `{code, message, retryable}`, FastAPI's `{detail}` (validation, unknown route), or the text."""
    method, path = response.request.method, response.request.url.path
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    if isinstance(body, dict) and isinstance(body.get("code"), str):
        return ApiError(response.status_code, body["code"], str(body.get("message", "")),
                        bool(body.get("retryable", False)), method, path)
    if isinstance(body, dict) and "detail" in body:
        detail = body["detail"]
        if isinstance(detail, list):  # pydantic validation errors: where and what
            detail = "; ".join(f"{'.'.join(str(x) for x in d.get('loc', []))}: {d.get('msg')}"
                               for d in detail if isinstance(d, dict))
        code = "invalid-payload" if response.status_code == 422 else f"http-{response.status_code}"
        return ApiError(response.status_code, code, str(detail), response.status_code >= 500, method, path)
    text = response.text.strip()[:500] or response.reason_phrase
    return ApiError(response.status_code, f"http-{response.status_code}", text, response.status_code >= 500,
                    method, path)


class Client:
    """Sync client (a CLI does one thing at a time). `transport` is for tests of the error mapping."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 30.0,
                 stream_read_timeout: float = 120.0, transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.stream_timeout = httpx.Timeout(timeout, read=stream_read_timeout)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout, transport=transport, headers=headers)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------- plumbing ----------
    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ConnectionFailed(f"cannot reach the orchestration service at {self.base_url} "
                                   f"({type(exc).__name__}: {exc})") from exc
        if response.status_code >= 400:
            raise error_from_response(response)
        return response

    def _json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = self._send(method, path, **kwargs)
        if not response.content:
            return {}
        try:
            return response.json()
        except json.JSONDecodeError as exc:
            raise ApiError(response.status_code, "bad-response", f"not JSON: {response.text[:200]!r}",
                           False, method, path) from exc

    @staticmethod
    def _conv(cid: str) -> str:
        return f"/v1/conversations/{_seg(cid)}"

    def _turn(self, cid: str, tid: str) -> str:
        return f"{self._conv(cid)}/turns/{_seg(tid)}"

    # ---------- conversations ----------
    def create_conversation(self, title: str | None = None,
                            settings: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"settings": settings or {}}
        if title:
            body["title"] = title
        return self._json("POST", "/v1/conversations", json=body)

    def upload_attachment(self, cid: str, path: Path, media_type: str | None = None) -> dict[str, Any]:
        with path.open("rb") as fh:  # streamed from disk by httpx: any size in bounded memory
            return self._json("POST", f"{self._conv(cid)}/attachments",
                              files={"file": (path.name, fh, media_type or guess_media_type(path))})

    def messages(self, cid: str, *, branches: bool = False) -> dict[str, Any]:
        """The conversation's path (root → newest); with `branches`, also the siblings of each message on it
        (`branches`: message id → its sibling ids, itself included)."""
        return self._json("GET", f"{self._conv(cid)}/messages",
                          params={"branches": "true"} if branches else None)

    def result(self, cid: str, mid: str, call_id: str) -> dict[str, Any]:
        return self._json("GET", f"{self._conv(cid)}/messages/{_seg(mid)}/results/{_seg(call_id)}")

    # ---------- API keys (an admin credential) ----------
    def create_key(self, tenant: str, *, name: str | None = None, admin: bool = False,
                   requests_per_second: int | None = None, max_running_turns: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"tenantId": tenant, "admin": admin}
        for k, v in (("name", name), ("requestsPerSecond", requests_per_second),
                     ("maxRunningTurns", max_running_turns)):
            if v is not None:
                body[k] = v
        return self._json("POST", "/v1/keys", json=body)

    def list_keys(self, tenant: str | None = None, *, revoked: bool = False) -> list[dict[str, Any]]:
        params: dict[str, str] = {"revoked": "true"} if revoked else {}
        if tenant:
            params["tenant"] = tenant
        return self._json("GET", "/v1/keys", params=params)["keys"]

    def revoke_key(self, key_id: str) -> dict[str, Any]:
        return self._json("DELETE", f"/v1/keys/{_seg(key_id)}")

    def whoami(self) -> dict[str, Any]:
        return self._json("GET", "/v1/whoami")

    # ---------- turns ----------
    def start_turn(self, cid: str, text: str, provider: dict[str, Any],
                   max_steps: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"text": text, "provider": provider}
        if max_steps is not None:
            body["maxSteps"] = max_steps
        return self._json("POST", f"{self._conv(cid)}/turns", json=body)

    def turn(self, cid: str, tid: str) -> dict[str, Any]:
        return self._json("GET", self._turn(cid, tid))

    def abort(self, cid: str, tid: str, reason: str | None = None) -> dict[str, Any]:
        return self._json("POST", f"{self._turn(cid, tid)}/abort", json={"reason": reason} if reason else {})

    def regenerate(self, cid: str, tid: str, provider: dict[str, Any] | None = None,
                   max_steps: int | None = None) -> dict[str, Any]:
        """A new turn answering the same user message; without `provider` the server reuses the turn's own."""
        body: dict[str, Any] = {}
        if provider is not None:
            body["provider"] = provider
        if max_steps is not None:
            body["maxSteps"] = max_steps
        return self._json("POST", f"{self._turn(cid, tid)}/regenerate", json=body)

    def served_request(self, cid: str, tid: str, step: int) -> ServedRequest:
        response = self._send("GET", f"{self._turn(cid, tid)}/steps/{int(step)}/request")
        try:
            doc = response.json()
        except json.JSONDecodeError as exc:
            raise ApiError(response.status_code, "bad-response", "the served request is not JSON",
                           False, "GET", response.request.url.path) from exc
        return ServedRequest(raw=response.content, doc=doc)

    def events(self, cid: str, tid: str, *, last_event_id: int | None = None, max_retries: int = 8,
               backoff_s: float = 0.25, unreachable_s: float = 120.0, sleep: Callable[[float], None] = time.sleep,
               clock: Callable[[], float] = time.monotonic) -> Iterator[Event]:
        """The turn's events until its terminal one, however long the turn takes to come back from a fault.

        A dropped or timed-out stream is reopened with Last-Event-ID (the server resumes after it), so no event is
        lost or repeated. When an attempt brings no new event (the edge restarting, a backend away, a 5xx), the
        turn itself is read (GET …/turns/{id}): the events it holds past the last one seen are yielded, and if the
        turn ended that is the end — a turn that completed while the stream was down is reported as completed.
        There is no cap on reconnects while the server answers (an error status
        counts as an answer: the edge is up, its backends may be coming back) and the turn is not over; it gives up
        with ConnectionFailed only when the server could not be reached at all `max_retries` attempts in a row AND
        for `unreachable_s` seconds (an edge being restarted comes back within that). A missing turn or a refused
        credential is not retried (ApiError)."""
        path = f"{self._turn(cid, tid)}/events"
        last, unreachable, attempt = last_event_id, 0, 0
        unreachable_since: float | None = None
        while True:
            headers = {"Last-Event-ID": str(last)} if last is not None else {}
            reached, progressed = False, False
            try:
                with connect_sse(self.http, "GET", path, headers=headers, timeout=self.stream_timeout) as source:
                    reached = True
                    if source.response.status_code >= 400:
                        source.response.read()
                        raise error_from_response(source.response)
                    if source.response.status_code == 204:  # the turn ended and every event was seen already
                        return
                    for sse in source.iter_sse():
                        if not sse.data or not sse.id:  # keep-alives / comments carry no event
                            continue
                        event = Event(sse.event, int(sse.id), json.loads(sse.data))
                        if last is not None and event.id <= last:
                            continue  # a server that ignores Last-Event-ID must not make us repeat events
                        last, attempt, progressed = event.id, 0, True
                        yield event
                        if event.terminal:
                            return
                    cause = "the stream ended before the turn did"
            except SSEError as exc:  # a 200 that is not an event stream: retrying will not change it
                raise ApiError(200, "bad-response", str(exc), False, "GET", path) from exc
            except ApiError as exc:
                if not exc.retryable:
                    raise
                cause = str(exc)
            except httpx.ConnectError as exc:
                if last is None and unreachable == 0 and attempt == 0:
                    # nothing there at all on the first call: say so now, not after the retries
                    raise ConnectionFailed(f"cannot reach the orchestration service at {self.base_url} "
                                           f"({exc})") from exc
                cause = f"ConnectError: {exc}"
            except httpx.TransportError as exc:
                reached = reached or isinstance(exc, httpx.ReadError | httpx.RemoteProtocolError)
                cause = f"{type(exc).__name__}: {exc}"
            if progressed:
                unreachable, unreachable_since = 0, None
                continue  # the stream was cut after new events: reopen it at once
            # the stream brought nothing new: what does the turn itself say?
            try:
                log = self.turn(cid, tid)
                reached = True
                ended = False
                for e in log.get("events") or []:
                    version = int(e["version"])
                    ended = ended or e["type"] in TERMINAL
                    if last is not None and version <= last:
                        continue
                    event = Event(e["type"], version, e.get("data") or {})
                    last, attempt = version, 0
                    yield event
                    if event.terminal:
                        return
                if ended:  # its terminal event was seen already
                    return
            except ApiError as exc:
                if not exc.retryable:
                    raise
                reached = True
            except ConnectionFailed:
                pass
            if reached:
                unreachable, unreachable_since = 0, None
            else:
                unreachable += 1
                unreachable_since = clock() if unreachable_since is None else unreachable_since
            if unreachable > max_retries and clock() - (unreachable_since or 0) >= unreachable_s:
                raise ConnectionFailed(f"lost the event stream of turn {tid} at {self.base_url}: unreachable "
                                       f"{unreachable} times in a row over {unreachable_s:.0f}s ({cause})")
            attempt += 1
            sleep(min(backoff_s * 2 ** (attempt - 1), 5.0))

