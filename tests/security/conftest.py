"""Attack tests (issue #15, SPEC §6 and §15.3): every test is one attack, marked ``security`` so
``pytest -m security`` (a later ``make test-security``) counts them. Helpers are in security_support.py."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "security: an attack on tenancy and trust (counted by make test-security)")
