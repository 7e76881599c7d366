"""Garbage-collection rules (SPEC §6), pure: what may be collected, given ages and what Postgres knows.

- A blob row with no reference whose last reference went away more than ``grace`` ago is collectable.
- An object ``blobs/<sha256>`` with no metadata row, older than ``grace``, is an orphan (a crash between the
  object write and the metadata transaction) and is collectable.
- An unfinished multipart upload or a staging object ``uploads/<id>`` older than ``stale`` is abandoned.

Every one of these is re-checked under the blob's exclusive advisory lock right before deletion (a put holds
the shared lock from its existence check to its metadata commit), so a concurrent put always wins.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from .keys import sha_from_key


@dataclass(frozen=True, slots=True)
class StoredObject:
    key: str
    last_modified: datetime


def orphan_candidates(objects: Iterable[StoredObject], known: set[str], cutoff: datetime) -> list[str]:
    """sha256s of blob objects older than ``cutoff`` that have no metadata row."""
    out = []
    for o in objects:
        sha = sha_from_key(o.key)
        if sha is not None and sha not in known and o.last_modified < cutoff:
            out.append(sha)
    return out


def cutoff(now: datetime, seconds: float) -> datetime:
    return now - timedelta(seconds=seconds)
