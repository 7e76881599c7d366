"""/healthz and /readyz (not in the API document): liveness, and readiness for the load balancer and Kubernetes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from faststream.nats import NatsBroker

from ..adapters.work_queue import TurnQueue


@dataclass
class Readiness:
    broker: NatsBroker
    queue: TurnQueue
    runs_turns: bool
    started: bool = False

    async def report(self) -> tuple[bool, dict[str, Any]]:
        """Ready = started, NATS answers and (runner role) the turn consumer is consuming: a pull loop that
        crashed (being restarted) or cannot fetch is not ready (SPEC §15.4)."""
        failing = [] if self.started else ["starting"]
        if not await self.broker.ping(timeout=1.0):
            failing.append("nats")
        body: dict[str, Any] = {}
        if self.runs_turns:
            body["consumers"] = [self.queue.health.report()]
            if self.started and not self.queue.health.ok:
                failing.append(f"consumer:{self.queue.health.name}")
        if failing:
            return False, {"status": "not-ready", "failing": failing, **body}
        return True, {"status": "ready", **body}


def router(readiness: Readiness) -> APIRouter:
    api = APIRouter(include_in_schema=False)

    @api.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "alive"}

    @api.get("/readyz")
    async def readyz() -> JSONResponse:
        ready, body = await readiness.report()
        return JSONResponse(body, status_code=200 if ready else 503)

    return api
