"""The durability floor of a gateway request (`make bench-gateway`'s fourth target): a bare HTTP proxy, no ctxbuild
code, doing per request only the durable work ctxbuild's guarantees imply, so the bench can show what those
guarantees cost at the least on this machine:

1. auth: the bearer key looked up in an in-memory dict;
2. one Postgres transaction (one statement, so one round trip and one commit): the request's last message and a
   ``queued`` turn row — the input is durable before the turn is taken;
3. the request forwarded to the upstream (one keep-alive httpx client) and, beside that call, the served request
   bytes PUT to S3 (minio in a worker thread, as the blob store does); both awaited;
4. one Postgres transaction: the answer stored and the turn marked ``answered`` — durable before the client sees it;
5. the upstream's body returned.

Same Postgres (fsync and synchronous_commit as the stack has them) and S3 (SeaweedFS) as the ctxbuild stack, in its
own schema and key prefix. Non-streamed only: a streamed request is answered 501.

    python bench/durable_floor.py --port P --upstream http://127.0.0.1:U/v1 --key sk-...
    (env: CTX_DATABASE_URL, CTX_S3_ENDPOINT, CTX_S3_ACCESS_KEY, CTX_S3_SECRET_KEY, CTX_S3_BUCKET)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import asyncpg
import httpx
import uvicorn
from minio import Minio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

SCHEMA = "bench_floor"
DDL = f"""
CREATE SCHEMA IF NOT EXISTS {SCHEMA};
CREATE TABLE IF NOT EXISTS {SCHEMA}.messages (
    id bigserial PRIMARY KEY, tenant text NOT NULL, role text NOT NULL, body jsonb NOT NULL,
    created timestamptz NOT NULL DEFAULT now());
CREATE TABLE IF NOT EXISTS {SCHEMA}.turns (
    id bigserial PRIMARY KEY, tenant text NOT NULL, input_id bigint NOT NULL REFERENCES {SCHEMA}.messages,
    answer_id bigint REFERENCES {SCHEMA}.messages, status text NOT NULL, request_key text,
    created timestamptz NOT NULL DEFAULT now(), updated timestamptz NOT NULL DEFAULT now());
"""
# the input message and its queued turn, atomically (a single statement is its own transaction)
QUEUE = f"""
WITH m AS (INSERT INTO {SCHEMA}.messages (tenant, role, body) VALUES ($1, 'user', $2::jsonb) RETURNING id)
INSERT INTO {SCHEMA}.turns (tenant, input_id, status) SELECT $1, id, 'queued' FROM m RETURNING id
"""
ANSWER = f"""
WITH a AS (INSERT INTO {SCHEMA}.messages (tenant, role, body) VALUES ($1, 'assistant', $3::jsonb) RETURNING id)
UPDATE {SCHEMA}.turns SET status = 'answered', answer_id = (SELECT id FROM a), request_key = $4, updated = now()
WHERE id = $2
"""


def build(upstream: str, upstream_key: str, keys: dict[str, str]) -> Starlette:
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        pool = await asyncpg.create_pool(os.environ["CTX_DATABASE_URL"], min_size=4, max_size=16)
        async with pool.acquire() as c:
            await c.execute(DDL)
            state["pg_settings"] = {k: await c.fetchval(f"SHOW {k}") for k in ("fsync", "synchronous_commit")}
        s3 = urlsplit(os.environ["CTX_S3_ENDPOINT"])
        state.update(pool=pool, bucket=os.environ["CTX_S3_BUCKET"],
                     s3=Minio(s3.netloc, access_key=os.environ["CTX_S3_ACCESS_KEY"],
                              secret_key=os.environ["CTX_S3_SECRET_KEY"], secure=s3.scheme == "https"))
        async with httpx.AsyncClient(base_url=upstream, timeout=300,
                                     headers={"Authorization": f"Bearer {upstream_key}"}) as http:
            state["http"] = http
            yield
        await pool.close()

    def put(key: str, data: bytes) -> None:
        state["s3"].put_object(state["bucket"], key, io.BytesIO(data), len(data), content_type="application/json")

    async def chat(request: Request) -> Response:
        tenant = keys.get(request.headers.get("authorization", "").removeprefix("Bearer "))
        if tenant is None:
            return JSONResponse({"error": {"message": "invalid api key"}}, status_code=401)
        raw = await request.body()
        body = json.loads(raw)
        if body.get("stream"):
            return JSONResponse({"error": {"message": "the floor does not stream"}}, status_code=501)
        pool = state["pool"]
        turn = await pool.fetchval(QUEUE, tenant, json.dumps(body["messages"][-1]))
        key = f"{SCHEMA}/{tenant}/{turn}"
        loop = asyncio.get_running_loop()
        stored = loop.run_in_executor(None, put, key, raw)  # beside the upstream call
        upstream = state["http"].post("/chat/completions", content=raw, headers={"content-type": "application/json"})
        r, _ = await asyncio.gather(upstream, stored)
        if r.status_code != 200:
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        await pool.execute(ANSWER, tenant, turn, r.content.decode(), key)
        return Response(r.content, media_type="application/json")

    async def health(_: Request) -> Response:
        return JSONResponse({"ok": "pool" in state, "postgres": state.get("pg_settings")})

    async def written(_: Request) -> Response:
        """What the floor made durable (the bench checks it against the requests it sent): answered turns and
        S3 objects."""
        answered = await state["pool"].fetchval(f"SELECT count(*) FROM {SCHEMA}.turns WHERE status = 'answered'")
        objects = await asyncio.to_thread(
            lambda: sum(1 for _ in state["s3"].list_objects(state["bucket"], prefix=f"{SCHEMA}/", recursive=True)))
        return JSONResponse({"turns_answered": answered, "s3_objects": objects})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/health", health),
                             Route("/written", written)],
                     lifespan=lifespan)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True, help="OpenAI base URL, …/v1")
    ap.add_argument("--upstream-key", default="sk-upstream")
    ap.add_argument("--key", required=True, help="the one client key accepted (tenant 'bench')")
    args = ap.parse_args()
    app = build(args.upstream, args.upstream_key, {args.key: "bench"})
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
