"""A message a batch's commit hands on: published to JetStream right after the commit (``ctx.persist.append_batch``
``enqueue``), so the caller's next step — a turn's work-queue command, mostly — need not wait for the reply to
travel back and be published from there. Only subjects under the configured prefix; the stream is the caller's
(persistence creates none): no stream, a timeout, any failure is "not enqueued", and the caller publishes itself."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import structlog
from ctxbuild_platform.errors import InvalidPayload
from ctxbuild_platform.telemetry import publish_span
from nats.aio.client import Client as NatsClient

log = structlog.get_logger("enqueue")


class Enqueuer:
    def __init__(self, connection: Callable[[], NatsClient], subject_prefix: str, timeout_s: float) -> None:
        self._connection = connection
        self.subject_prefix = subject_prefix
        self.timeout_s = timeout_s

    def check(self, subject: str) -> None:
        """Refuse a subject outside the prefix (or not a plain subject) before anything is stored."""
        if (not self.subject_prefix or not subject.startswith(self.subject_prefix)
                or any(c in subject for c in "*> \t\r\n") or "" in subject.split(".")):
            raise InvalidPayload(f"enqueue.subject {subject!r} is not under {self.subject_prefix!r} "
                                 "(CTX_ENQUEUE_SUBJECT_PREFIX)", details={"subject": subject})

    async def publish(self, subject: str, msg_id: str, body: dict[str, Any]) -> bool:
        """Publish with ``Nats-Msg-Id`` (a repeat within the stream's duplicate window is dropped); True once
        JetStream acknowledged it (a dropped duplicate included), False on any failure."""
        payload = json.dumps(body, ensure_ascii=False).encode()
        headers = {"Nats-Msg-Id": msg_id}
        try:
            with publish_span(subject, headers):
                await self._connection().jetstream(timeout=self.timeout_s).publish(subject, payload, headers=headers)
            return True
        except Exception as exc:  # noqa: BLE001 - the commit stands; the caller publishes it instead
            log.warning("enqueue-failed", subject=subject, msg_id=msg_id, error=f"{type(exc).__name__}: {exc}"[:300])
            return False
