"""Helpers shared by the tests that run the services over real material (../shared/data) and by the cross-lane
tests: which services a module starts, how a conversation is opened, and how a FreshWiki page reads as text."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

# a test module over the shared data that runs the services (skips cleanly when the data is absent)
REAL_DATA_SERVICES = [pytest.mark.integration, pytest.mark.shared_data]


def services_fixture(*names: str) -> Callable[..., None]:
    """A module-scoped ``services`` fixture that starts ``names`` on the session's stack (once per session)."""

    @pytest.fixture(scope="module")
    def services(start_service) -> None:
        for name in names:
            start_service(name)

    return services


async def start_conversation(rpc, cid: str, user_id: str, text: str) -> str:
    """Open conversation ``cid`` with one user message (id ``user_id``); returns ``cid``."""
    await rpc.call("ctx.persist.append", {"streamId": f"conversation:{cid}", "expectedVersion": 0, "events": [
        {"eventId": str(uuid.uuid4()), "type": "UserMessageAdded",
         "data": {"message": {"id": user_id, "role": "user", "parts": [{"type": "text", "text": text}]}}}]})
    return cid


def freshwiki_text(sections: list[dict[str, Any]], depth: int = 2) -> str:
    """A FreshWiki article's sections as markdown-ish text (headings by depth, sentences joined)."""
    out = []
    for s in sections:
        out.append("#" * depth + " " + s["section_title"])
        out.append(" ".join(x["sentence"] for x in s.get("section_content") or []))
        out.append(freshwiki_text(s.get("subsections") or [], depth + 1))
    return "\n\n".join(p for p in out if p)
