"""Append planning: optimistic concurrency and idempotency by event id, decided from what the store holds.

The adapter reads, under the append lock, the stream's current version and which of the request's event ids
already exist; :func:`plan_append` decides what to insert. Rules:

- an event whose id is already stored (or repeated earlier in the same request) is a *duplicate*: not stored
  again, reported with its stored position;
- all events duplicates → success without a version check (a retry of an acknowledged append must succeed);
- otherwise ``expectedVersion``: ``None`` = any, ``0`` = the stream must not exist yet, ``n`` = its last version
  must be ``n``; new events get versions ``current+1 …`` in request order;
- an id already stored on *another* stream is a caller bug, never silently a duplicate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ctxbuild_platform.errors import Conflict


@dataclass(frozen=True)
class NewEvent:
    event_id: str  # canonical lower-case uuid text
    type: str
    data: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)
    # the JSON text stored for data / metadata, when the append's checks already encoded it (None: the store
    # encodes it): one encoding per event, not one per use
    data_json: str | None = field(default=None, repr=False)
    metadata_json: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class StoredRef:
    """Where an already-stored event lives."""

    stream_id: str
    version: int
    position: int


@dataclass(frozen=True)
class AppendPlan:
    stream_id: str
    to_insert: list[tuple[int, NewEvent]]  # (version, event) in request order
    # per request slot: ("new", index into to_insert) or ("dup", StoredRef) or ("dup-in-request", slot)
    slots: list[tuple[str, Any]]
    duplicates: int

    def result(self, inserted_positions: list[int]) -> dict[str, Any]:
        """The reply, given the positions the store assigned to ``to_insert`` (same order)."""
        if len(inserted_positions) != len(self.to_insert):
            raise ValueError("one position per inserted event expected")
        positions: list[int] = []
        versions: list[int] = []
        for kind, ref in self.slots:
            if kind == "new":
                positions.append(inserted_positions[ref])
                versions.append(self.to_insert[ref][0])
            elif kind == "dup":
                positions.append(ref.position)
                versions.append(ref.version)
            else:  # repeated inside the request: same as the earlier slot
                positions.append(positions[ref])
                versions.append(versions[ref])
        return {
            "streamId": self.stream_id,
            "fromVersion": min(versions),
            "toVersion": max(versions),
            "positions": positions,
            "duplicates": self.duplicates,
        }


def plan_append(stream_id: str, expected_version: int | None, events: list[NewEvent], current_version: int,
                existing: dict[str, StoredRef]) -> AppendPlan:
    if not events:
        raise ValueError("an append needs at least one event")
    slots: list[tuple[str, Any]] = []
    fresh: list[NewEvent] = []
    first_slot: dict[str, int] = {}
    duplicates = 0
    for i, ev in enumerate(events):
        if ev.event_id in first_slot:
            slots.append(("dup-in-request", first_slot[ev.event_id]))
            duplicates += 1
            continue
        first_slot[ev.event_id] = i
        ref = existing.get(ev.event_id)
        if ref is not None:
            if ref.stream_id != stream_id:
                raise Conflict(
                    f"event {ev.event_id} is already stored on stream {ref.stream_id!r}, not {stream_id!r}",
                    code="event-id-conflict",
                    details={"eventId": ev.event_id, "storedStreamId": ref.stream_id, "streamId": stream_id})
            slots.append(("dup", ref))
            duplicates += 1
            continue
        slots.append(("new", len(fresh)))
        fresh.append(ev)

    if fresh and expected_version is not None and expected_version != current_version:
        raise Conflict(
            f"stream {stream_id!r} is at version {current_version}, expected {expected_version}",
            details={"streamId": stream_id, "expectedVersion": expected_version, "actualVersion": current_version})
    to_insert = [(current_version + 1 + k, ev) for k, ev in enumerate(fresh)]
    return AppendPlan(stream_id=stream_id, to_insert=to_insert, slots=slots, duplicates=duplicates)
