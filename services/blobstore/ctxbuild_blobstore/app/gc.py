"""Garbage collection (SPEC §6): blobs unreferenced for longer than the grace period, orphan objects left by a
crash between the object write and the metadata commit, and abandoned uploads.

One round, one replica at a time (a Postgres advisory lock elects the collector):
1. blob rows with no reference since before ``now − grace``: under the blob's *exclusive* lock (taken with
   ``pg_try_advisory_lock``: a writer holding it shared makes us skip, never wait) re-check and delete the row,
   then delete the object. A crash in between leaves an object without metadata — step 2's case.
2. objects ``blobs/<sha256>`` older than ``now − grace`` without a metadata row: under the exclusive lock,
   re-check that there is still no row, then delete the object.
3. multipart uploads started before ``now − upload_stale`` are aborted; staging objects ``uploads/…`` older than
   that are deleted.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import UTC, datetime

import structlog
from ctxbuild_codec.models.subjects.ctx_blob_gc_reply import CtxBlobGcReply
from ctxbuild_codec.models.subjects.ctx_blob_gc_request import CtxBlobGcRequest
from ctxbuild_platform.errors import ServiceError

from ..adapters.postgres import Postgres
from ..adapters.s3 import ObjectStore
from ..domain.gcpolicy import cutoff, orphan_candidates
from ..domain.keys import BLOB_PREFIX, UPLOAD_PREFIX, object_key

log = structlog.get_logger("blobstore.gc")


@dataclass
class GcReport:
    ran: bool = True
    blobs: int = 0  # unreferenced blobs deleted (row + object)
    orphans: int = 0  # objects without metadata deleted
    uploads: int = 0  # abandoned multipart uploads aborted
    staging: int = 0  # staging objects deleted
    skipped: int = 0  # busy (a writer held the blob's lock): next round
    errors: list[str] = field(default_factory=list)

    def to_reply(self) -> CtxBlobGcReply:
        return CtxBlobGcReply(ran=self.ran, blobs=self.blobs, orphans=self.orphans, uploads=self.uploads,
                              staging=self.staging, skipped=self.skipped, errors=self.errors[:20])


class Collector:
    def __init__(self, db: Postgres, s3: ObjectStore, *, grace_s: float, upload_stale_s: float,
                 batch: int = 500, on_delete=None) -> None:
        self.db = db
        self.s3 = s3
        self.grace_s = grace_s
        self.upload_stale_s = upload_stale_s
        self.batch = batch
        self.on_delete = on_delete  # callback(sha256): e.g. drop a cache entry

    def _deleted(self, sha: str) -> None:
        if self.on_delete is not None:
            self.on_delete(sha)

    async def gc(self, req: CtxBlobGcRequest) -> CtxBlobGcReply:
        """Run one garbage-collection round now (it also runs in the background every gc_interval_s)."""
        return (await self.run_once()).to_reply()

    async def run_once(self) -> GcReport:
        async with self.db.gc_leader() as leader:
            if not leader:
                return GcReport(ran=False)
            report = GcReport()
            await self._unreferenced(report)
            await self._orphans(report)
            await self._uploads(report)
            if report.blobs or report.orphans or report.uploads or report.staging:
                log.info("gc-round", **report.to_reply().model_dump())
            return report

    async def _unreferenced(self, report: GcReport) -> None:
        seen: set[str] = set()
        while True:
            shas = [s for s in await self.db.collectable(self.grace_s, self.batch) if s not in seen]
            if not shas:
                return
            for sha in shas:
                seen.add(sha)
                async with self.db.exclusive(sha) as conn:
                    if conn is None:
                        report.skipped += 1
                        continue
                    if not await self.db.delete_if_collectable(conn, sha, self.grace_s):
                        continue
                    self._deleted(sha)
                    report.blobs += 1
                    try:
                        await self.s3.remove(object_key(sha))
                    except ServiceError as exc:  # the object is now an orphan: the next round removes it
                        report.errors.append(f"{sha}: {exc.message}")

    async def _orphans(self, report: GcReport) -> None:
        limit = cutoff(datetime.now(UTC), self.grace_s)
        async for batch in self.s3.list_objects(BLOB_PREFIX, self.batch):
            old = [o for o in batch if o.last_modified < limit]
            if not old:
                continue
            known = await self.db.known([o.key[len(BLOB_PREFIX):] for o in old])
            for sha in orphan_candidates(old, known, limit):
                async with self.db.exclusive(sha) as conn:
                    if conn is None:
                        report.skipped += 1
                        continue
                    if not await self.db.is_orphan(conn, sha):
                        continue
                    try:
                        await self.s3.remove(object_key(sha))
                    except ServiceError as exc:
                        report.errors.append(f"{sha}: {exc.message}")
                        continue
                    self._deleted(sha)
                    report.orphans += 1

    async def _uploads(self, report: GcReport) -> None:
        limit = cutoff(datetime.now(UTC), self.upload_stale_s)
        for prefix in (UPLOAD_PREFIX, BLOB_PREFIX):
            for up in await self.s3.pending_uploads(prefix):
                if up.initiated is not None and up.initiated < limit:
                    await self.s3.abort_multipart(up.key, up.upload_id)
                    report.uploads += 1
        async for batch in self.s3.list_objects(UPLOAD_PREFIX, self.batch):
            for o in batch:
                if o.last_modified < limit:
                    await self.s3.remove(o.key)
                    report.staging += 1


async def gc_loop(collector: Collector, interval_s: float) -> None:
    """Background rounds until cancelled; a failing round (S3/Postgres down) is logged and retried later."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await collector.run_once()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - never let GC take the service down
            log.warning("gc-round-failed", error=f"{type(exc).__name__}: {exc}"[:300])
