"""A test's own subject beside the real contracts, for a server running in the test process."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from ctxbuild_platform import contracts

REPO_CONTRACTS = Path(__file__).resolve().parents[2] / "contracts"


def with_subject(tmp_path_factory: pytest.TempPathFactory, subject: str, schema: dict) -> Iterator[Path]:
    """Yields a copy of the real contracts plus ``schema`` as ``subject``'s request and reply, loaded (and cached)
    for this process only: the environment is restored at once, so service processes started meanwhile read the
    real ones. For a module fixture: ``yield from with_subject(...)``."""
    root = tmp_path_factory.mktemp("contracts") / "contracts"
    shutil.copytree(REPO_CONTRACTS, root)
    for kind in ("request", "reply"):
        (root / "subjects" / f"{subject}.{kind}.json").write_text(json.dumps(schema))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CTX_CONTRACTS_DIR", str(root))
        contracts.reset_cache()
        assert contracts.has_contract(f"subjects/{subject}.request.json")  # loaded (and cached) from root
    yield root
    contracts.reset_cache()
