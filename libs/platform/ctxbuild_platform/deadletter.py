"""Dead letters (SPEC §15.4): a JetStream message no consumer can process is parked, never retried forever.

Every JetStream consumer of the platform parks a message it cannot take (undecodable, invalid, or delivered more
than its bound) here and then ``term``s it, so the consumer goes on with the next one:

- stream ``CTX_DEAD_LETTERS`` (file storage, limits retention, ``max_age`` 14 days), subjects ``ctx.dlq.>``;
- subject ``ctx.dlq.<original subject>``; body = the original payload, byte for byte — or, when the payload plus
  the dead-letter headers would not fit in one message, an empty body and the original in the claim store
  (``Ctx-Claim`` header, :mod:`ctxbuild_platform.claims`, kept for the claim bucket's TTL);
- headers ``Ctx-Dlq-Subject``, ``Ctx-Dlq-Stream``, ``Ctx-Dlq-Consumer``, ``Ctx-Dlq-Sequence`` (the stream
  sequence of the original), ``Ctx-Dlq-Deliveries``, ``Ctx-Dlq-Reason`` (one line, ≤ 1000 chars),
  ``Ctx-Dlq-Service``, ``Ctx-Dlq-Size`` (original bytes); ``Nats-Msg-Id`` = ``<stream>:<sequence>`` so a park
  retried after a lost ack is stored once.

A park that fails (NATS trouble) leaves the original unacknowledged: it comes back and is parked next time.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from nats.aio.client import Client
from nats.js.api import RetentionPolicy, StorageType, StreamConfig

from . import claims
from .streams import ensure_stream

log = structlog.get_logger("dead-letters")

STREAM = "CTX_DEAD_LETTERS"
PREFIX = "ctx.dlq"
HEADER_ROOM = 4096  # the dead-letter headers' share of a message
_LINE = re.compile(r"[\x00-\x1f\x7f]+")


def header_text(value: Any, limit: int = 1000) -> str:
    """A header value: one line of printable text (NATS headers cannot hold CR/LF)."""
    text = _LINE.sub(" ", str(value)).encode("utf-8", "replace").decode("utf-8", "replace")
    return text[:limit]


@dataclass(frozen=True)
class DeadLetterConfig:
    stream: str = STREAM
    prefix: str = PREFIX
    replicas: int = 1
    max_age_s: float = 14 * 24 * 3600


class DeadLetters:
    """Parks messages on the dead-letter stream; one per process and connection getter."""

    def __init__(self, connection: Callable[[], Client], service: str, config: DeadLetterConfig | None = None) -> None:
        self._connection = connection
        self.service = service
        self.config = config or DeadLetterConfig()
        self._ready = False
        self.parked_total = 0

    def _js(self):
        return self._connection().jetstream(timeout=10)

    async def ensure(self) -> None:
        """Create the stream if it is missing (idempotent; another replica's identical create is fine)."""
        c = self.config
        await ensure_stream(self._js(), StreamConfig(
            name=c.stream, subjects=[f"{c.prefix}.>"], retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE, max_age=c.max_age_s, num_replicas=c.replicas,
            description="ctxbuild dead letters: messages a consumer could not process"))
        self._ready = True

    async def park(self, msg: Any, reason: str, *, consumer: str = "") -> bool:
        """Store ``msg`` (a nats-py JetStream message) with its reason, then ``term`` it. Returns False (and
        leaves the message to come back) if the dead-letter stream could not take it."""
        try:
            if not self._ready:
                await self.ensure()
            meta = msg.metadata
            stream = meta.stream or ""
            seq = meta.sequence.stream if meta.sequence else 0
            data: bytes = msg.data or b""
            headers = {
                "Ctx-Dlq-Subject": header_text(msg.subject, 512),
                "Ctx-Dlq-Stream": header_text(stream, 256),
                "Ctx-Dlq-Consumer": header_text(consumer or meta.consumer or "", 256),
                "Ctx-Dlq-Sequence": str(seq),
                "Ctx-Dlq-Deliveries": str(meta.num_delivered or 1),
                "Ctx-Dlq-Reason": header_text(reason),
                "Ctx-Dlq-Service": header_text(self.service, 128),
                "Ctx-Dlq-Size": str(len(data)),
                "Nats-Msg-Id": f"{stream}:{seq}",
            }
            store = claims.store(self._connection())
            if len(data) + HEADER_ROOM > store.inline_limit():  # the original stays whole, by claim
                claim = await store.put(data, shared=True)
                headers.update(claims.claim_headers(claim))
                data = b""
            await self._js().publish(f"{self.config.prefix}.{msg.subject}", data, headers=headers,
                                     stream=self.config.stream)
        except Exception as exc:  # noqa: BLE001 - the message comes back and is parked next time
            self._ready = False
            log.error("dead-letter-failed", subject=getattr(msg, "subject", None), reason=reason[:300],
                      error=f"{type(exc).__name__}: {exc}"[:300])
            return False
        self.parked_total += 1
        log.error("message-parked", subject=msg.subject, stream=stream, sequence=seq,
                  deliveries=meta.num_delivered, reason=reason[:300], dead_letter_stream=self.config.stream)
        try:
            await msg.term()
        except Exception as exc:  # noqa: BLE001 - parked already; a redelivery is parked again (same Msg-Id)
            log.warning("term-failed", subject=msg.subject, error=str(exc)[:200])
        return True
