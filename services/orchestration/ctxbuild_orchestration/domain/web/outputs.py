"""Tool outputs of the web tools (SPEC §1): ``json`` entity lists for the entities codec, typed error texts."""

from __future__ import annotations

import secrets
import string
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

_ID_ALPHABET = string.ascii_letters + string.digits


class WebToolError(Exception):
    """A failure the model is told about: ``[Error: <code>] <message>``. Codes are stable (tests and the model
    rely on them): invalid-input, invalid-url, blocked-address, timeout, fetch-failed, too-many-redirects,
    http-<status>, unsupported-media, empty-content, extraction-failed, search-failed, unavailable."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"[Error: {code}] {message}")
        self.code = code
        self.message = message

    def output(self) -> dict[str, Any]:
        return error_output(self.code, self.message)


@dataclass(frozen=True, slots=True)
class Entity:
    """One citable thing: a fetched page or a search hit."""

    title: str
    url: str
    content: str


def error_output(code: str, message: str) -> dict[str, Any]:
    return {"type": "error-text", "value": f"[Error: {code}] {message}"}


def entity_prefix() -> str:
    """8 random letters/digits; ids are ``<prefix>-<n>``, fresh per call so two calls never share a citation id."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(8))


def entities_output(entities: Iterable[Entity], prefix: str | None = None) -> dict[str, Any]:
    """``{"type": "json", "value": [{id, title, url, content}, …]}`` — the shape the entities codec splits into a
    citation skeleton (id/title/url) and trimmable ``content``."""
    p = prefix or entity_prefix()
    return {"type": "json", "value": [{"id": f"{p}-{n}", "title": e.title, "url": e.url, "content": e.content}
                                      for n, e in enumerate(entities, start=1)]}
