"""The session stack's API key, for tests that call the orchestration HTTP API: ``headers=AUTH`` (a client:
``httpx.AsyncClient(..., headers=AUTH)``). Filled by tests/conftest.py's ``start_service`` when orchestration
starts (the stack issues its local key with the admin key, ``Stack.ensure_api_key``)."""

from __future__ import annotations

AUTH: dict[str, str] = {}
