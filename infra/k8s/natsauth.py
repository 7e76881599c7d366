"""Checks of the NATS accounts file (dependencies/nats/values-auth.yaml) against the code, offline.

1. ``nats_conf``: the chart's ``config.merge`` as a nats-server config (JSON is valid NATS config; the chart's
   ``<< $VAR >>`` becomes the bare variable) — ``nats-server -t`` must accept it.
2. ``contract_errors``: every subject a service serves (contracts/asyncapi.json, ``receive``) is subscribable by
   that service's user and by no other; ``source_errors``: every other service's subject named in a service's
   source (or in the blob client it depends on) is publishable by that service's user; ``inbox_errors``: each
   user subscribes to its own inboxes ``_INBOX.<user>.>`` and to no other inbox (nobody reads another's replies).
3. ``live_errors``: a real nats-server with this config; each service's real NATS calls (the work-queue adapter,
   the KV adapters, JetStream streams, request/reply, the chunked transfer's inbox traffic, the platform's claim
   check in the Object Store bucket CTX_CLAIMS) must pass — each client with its inbox prefix ``_INBOX.<user>`` as
   the services connect in the cluster — and calls outside a service's lists must be refused (another
   service's inboxes, or all of ``_INBOX.>``, included).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import yaml

REPO = Path(__file__).resolve().parents[2]
VALUES_AUTH = REPO / "infra/k8s/dependencies/nats/values-auth.yaml"
ACCOUNT = "CTXBUILD"

# subject prefix → the NATS users (service) that serve it; ctx.turn.* is orchestration's (edge and runner)
OWNER = {"blob": ("blobstore",), "persist": ("persistence",), "compact": ("compaction",),
         "truncate": ("truncation",), "mcp": ("mcp-catalog",), "turn": ("orchestration", "orchestration-runner"),
         "evt": ("persistence",)}
# NATS user → the packages whose source it runs
SOURCES = {
    "orchestration": ["services/orchestration"], "orchestration-runner": ["services/orchestration"],
    "truncation": ["services/truncation"], "persistence": ["services/persistence"],
    "blobstore": ["services/blobstore"], "compaction": ["services/compaction"],
    "mcp-catalog": ["services/mcp_catalog"],
}
SUBJECT_LITERAL = re.compile(r"""["'](ctx\.(?:""" + "|".join(OWNER) + r""")\.[a-z_.]+)["']""")
VAR = re.compile(r"^<<\s*\$([A-Za-z_][A-Za-z0-9_]*)\s*>>$")


@dataclass(frozen=True)
class Perms:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def load_values(path: Path = VALUES_AUTH) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def users(values: dict[str, Any]) -> dict[str, Perms]:
    out: dict[str, Perms] = {}
    for u in values["config"]["merge"]["accounts"][ACCOUNT]["users"]:
        p = u.get("permissions") or {}
        out[u["user"]] = Perms(tuple((p.get("publish") or {}).get("allow") or ()),
                               tuple((p.get("subscribe") or {}).get("allow") or ()))
    return out


def password_vars(values: dict[str, Any]) -> dict[str, str]:
    """user → the env variable its password comes from (every account)."""
    out = {}
    for acc in values["config"]["merge"]["accounts"].values():
        for u in acc.get("users", []):
            m = VAR.match(str(u.get("password", "")))
            if not m:
                raise ValueError(f"NATS user {u['user']!r}: the password must be a << $VAR >> from a Secret")
            out[u["user"]] = m.group(1)
    return out


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` one token, ``>`` one or more trailing tokens."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def _unvar(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _unvar(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_unvar(v) for v in node]
    if isinstance(node, str) and VAR.match(node):
        return {"__var__": VAR.match(node).group(1)}
    return node


def nats_conf(values: dict[str, Any], *, port: int, store_dir: str) -> str:
    body = dict(_unvar(values["config"]["merge"]))
    body["listen"] = f"127.0.0.1:{port}"
    body["jetstream"] = {"store_dir": store_dir}
    text = json.dumps(body, indent=2)
    return re.sub(r'\{\s*"__var__":\s*"([A-Za-z0-9_]+)"\s*\}', r"$\1", text)


def contract_errors(values: dict[str, Any], asyncapi: dict[str, Any]) -> list[str]:
    perms, errors = users(values), []
    for op in asyncapi["operations"].values():
        if op.get("action") != "receive":
            continue
        subject = asyncapi["channels"][op["channel"]["$ref"].rsplit("/", 1)[1]]["address"]
        owners = OWNER.get(subject.split(".")[1])
        if owners is None:
            errors.append(f"{subject}: no owning service known for this prefix (natsauth.OWNER)")
            continue
        allowed = {user for user, p in perms.items() if any(matches(a, subject) for a in p.subscribe)}
        if not allowed & set(owners):
            errors.append(f"{subject}: served by {'/'.join(owners)}, whose NATS user may not subscribe to it")
        for user in sorted(allowed - set(owners)):
            errors.append(f"{subject}: NATS user {user} may subscribe to it, but {'/'.join(owners)} serves it")
    return errors


def _depends_on_blobclient(service_dir: Path) -> bool:
    return "ctxbuild-blobclient" in (service_dir / "pyproject.toml").read_text()


def called_subjects(user: str) -> set[str]:
    found: set[str] = set()
    dirs = [REPO / d for d in SOURCES[user]]
    if any(_depends_on_blobclient(d) for d in dirs):
        dirs.append(REPO / "libs/blobclient")
    for d in dirs:
        for py in d.rglob("*.py"):
            if "tests" not in py.parts:
                found.update(SUBJECT_LITERAL.findall(py.read_text()))
    own = {prefix for prefix, owners in OWNER.items() if user in owners}
    return {s for s in found if s.split(".")[1] not in own}


def inbox_prefix(user: str) -> str:
    """The inbox prefix a service connects with (CTX_NATS_INBOX_PREFIX, set by components/nats-auth)."""
    return f"_INBOX.{user}"


def inbox_errors(values: dict[str, Any]) -> list[str]:
    perms, errors = users(values), []
    for user in SOURCES:
        own = f"{inbox_prefix(user)}.>"
        subs = perms[user].subscribe if user in perms else ()
        if own not in subs:
            errors.append(f"{user} may not subscribe to its own inboxes {own}")
        for a in subs:
            if a != own and a.startswith(("_INBOX", "*", ">")):  # another's inbox, or every inbox by wildcard
                errors.append(f"{user} may subscribe to {a}: other services' replies (only {own} is its own)")
    return errors


def source_errors(values: dict[str, Any]) -> list[str]:
    from ctxbuild_platform.contracts import SUBJECT_FAMILIES

    perms, errors = users(values), []
    for user in SOURCES:
        if user not in perms:
            errors.append(f"NATS user {user} is missing from {VALUES_AUTH.name}")
            continue
        for subject in sorted(called_subjects(user)):
            # a family's literal is its prefix: the subjects sent are <family>.<id> (one per turn)
            sent = f"{subject}.id" if subject in SUBJECT_FAMILIES else subject
            if not any(matches(a, sent) for a in perms[user].publish):
                errors.append(f"{user} calls {subject} (in its source) but may not publish to it")
    return errors


# ----------------------------------------------------------------------------------------------------- live

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def nats_server(values: dict[str, Any], nats_bin: str) -> Iterator[tuple[str, dict[str, str]]]:
    """A nats-server with the accounts config and fresh passwords; yields (host:port, user → password)."""
    pw = {u: secrets.token_hex(12) for u in password_vars(values)}
    env = {var: pw[u] for u, var in password_vars(values).items()}
    with tempfile.TemporaryDirectory(prefix="ctx-natsauth-") as tmp:
        port = _free_port()
        conf = Path(tmp) / "nats.conf"
        conf.write_text(nats_conf(values, port=port, store_dir=str(Path(tmp) / "js")))
        proc = subprocess.Popen([nats_bin, "-c", str(conf)], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 10
            while True:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("nats-server did not start: " + proc.stderr.read().decode()[-500:])
                time.sleep(0.05)
            yield f"127.0.0.1:{port}", pw
        finally:
            proc.terminate()
            proc.wait(timeout=10)


class _Client:
    """A connection as one service's user that records the server's permission errors."""

    def __init__(self, address: str, user: str, password: str) -> None:
        self.url, self.user, self.violations = f"nats://{user}:{password}@{address}", user, []
        self.nc: Any = None

    async def __aenter__(self) -> Self:
        import nats

        async def on_error(exc: Exception) -> None:
            if "permissions violation" in str(exc).lower():
                self.violations.append(str(exc))

        self.nc = await nats.connect(self.url, error_cb=on_error, allow_reconnect=False, name=self.user,
                                     inbox_prefix=inbox_prefix(self.user))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.nc.drain()

    async def settle(self) -> list[str]:
        await self.nc.flush()
        await asyncio.sleep(0.05)  # async -ERR lines arrive after the PONG at the latest; this lets them land
        await self.nc.flush()
        return self.violations


async def _scenario(address: str, pw: dict[str, str]) -> list[str]:
    from ctxbuild_mcp_catalog.adapters.tool_cache import KvBuckets, KvToolCache, KvTurnStore
    from ctxbuild_orchestration.adapters.work_queue import QueueConfig, TurnQueue
    from ctxbuild_persistence.adapters.outbox import OutboxRelay

    errors: list[str] = []
    c = {u: _Client(address, u, pw[u]) for u in SOURCES}
    async with contextlib.AsyncExitStack() as stack:
        for cl in c.values():
            await stack.enter_async_context(cl)

        # every service answers its own subjects in its queue group
        async def answer(msg: Any) -> None:
            await msg.respond(b'{"result":{}}')

        serves = {"blobstore": "ctx.blob.put", "persistence": "ctx.persist.append", "compaction": "ctx.compact.in_loop",
                  "truncation": "ctx.truncate.step", "mcp-catalog": "ctx.mcp.resolve"}
        for user, subject in serves.items():
            await c[user].nc.subscribe(subject, queue=user, cb=answer)
        await c["mcp-catalog"].nc.subscribe("ctx.mcp.cancel", cb=answer)  # broadcast to its replicas
        await c["orchestration-runner"].nc.subscribe("ctx.turn.abort", cb=answer)
        for cl in c.values():
            await cl.nc.flush()

        # request/reply along the call graph
        calls = {"orchestration": ["ctx.persist.append", "ctx.blob.put", "ctx.mcp.resolve"],
                 "orchestration-runner": ["ctx.compact.in_loop", "ctx.truncate.step", "ctx.mcp.resolve",
                                          "ctx.persist.append", "ctx.blob.put"],
                 "truncation": ["ctx.blob.put"], "compaction": ["ctx.persist.append", "ctx.blob.put"],
                 "persistence": ["ctx.blob.put"]}
        for user, subjects in calls.items():
            for subject in subjects:
                try:
                    await c[user].nc.request(subject, b"{}", timeout=2)
                except Exception as exc:  # noqa: BLE001 - reported below
                    errors.append(f"{user} → {subject}: {type(exc).__name__} {exc}")

        # the chunked transfer: the blob store pulls chunks from the caller's inbox (upload) and the caller acks
        # the chunks pushed to it (get); every BlobClient user does both
        for user in ("orchestration", "orchestration-runner", "truncation", "persistence", "compaction"):
            inbox = c[user].nc.new_inbox()
            await c[user].nc.subscribe(inbox, cb=answer)
            await c[user].nc.flush()
            for attempt in (1, 2):  # a busy machine once answered no-responders right after the SUB: ask twice
                try:
                    await c["blobstore"].nc.request(inbox, b"chunk?", timeout=2)
                    break
                except Exception as exc:  # noqa: BLE001
                    if attempt == 2:
                        errors.append(f"blobstore → {user}'s inbox: {type(exc).__name__} {exc}")
                    await c[user].nc.flush()

        async def step(what: str, coro: Any) -> Any:
            try:
                return await asyncio.wait_for(coro, timeout=10)
            except Exception as exc:  # noqa: BLE001 - a refused call shows up as an error or a timeout
                errors.append(f"{what}: {type(exc).__name__} {exc}")
                return None

        # the work queue, through the real adapter: the edge creates and submits, the runner pulls and acks
        config = QueueConfig()
        edge_q = TurnQueue(lambda: c["orchestration"].nc, config)
        await step("orchestration: ensure CTX_TURNS", edge_q.ensure())
        await step("orchestration: submit a turn", edge_q.submit("turn-1", "conv-1"))
        await c["orchestration"].nc.publish("ctx.turn.abort", b'{"turnId":"turn-1"}')
        # the runner's live notices of a turn reach the edge (text deltas, the end notice)
        heard: list[str] = []

        async def hear(msg: Any) -> None:
            heard.append(msg.subject)

        await c["orchestration"].nc.subscribe("ctx.turn.*.turn-1", cb=hear)
        await c["orchestration"].nc.flush()
        for subject in ("ctx.turn.delta.turn-1", "ctx.turn.ended.turn-1", "ctx.turn.appended.turn-1"):
            await c["orchestration-runner"].nc.publish(subject, b"{}")
        await c["orchestration-runner"].nc.flush()
        await c["orchestration"].nc.publish("ctx.turn.appended.turn-1", b"{}")  # the edge's abort request
        await c["orchestration"].nc.flush()
        for subject in ("ctx.turn.appended.turn-1", "ctx.turn.ended.turn-1"):  # persistence, after a turn's end
            await c["persistence"].nc.publish(subject, b"{}")
        await c["persistence"].nc.flush()
        expected = ["ctx.turn.appended.turn-1", "ctx.turn.appended.turn-1", "ctx.turn.appended.turn-1",
                    "ctx.turn.delta.turn-1", "ctx.turn.ended.turn-1", "ctx.turn.ended.turn-1"]
        for _ in range(50):
            if len(heard) == len(expected):
                break
            await asyncio.sleep(0.02)
        if sorted(heard) != expected:
            errors.append(f"orchestration did not hear the turn's delta/ended/appended notices (got {heard})")
        runner_q = TurnQueue(lambda: c["orchestration-runner"].nc, config)
        await step("orchestration-runner: ensure CTX_TURNS", runner_q.ensure())
        stopping, got = asyncio.Event(), []

        async def handle(d: Any) -> None:
            await d.msg.in_progress()
            await d.msg.ack()
            got.append(d.turn_id)
            stopping.set()

        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(runner_q.consume(handle, 1, stopping), timeout=5)
        if got != ["turn-1"]:
            errors.append(f"orchestration-runner did not receive the queued turn through CTX_TURNS (got {got})")

        # the outbox relay's stream (real adapter) and a deduplicated event publish
        relay = OutboxRelay(None, lambda: c["persistence"].nc, stream="CTX_EVENTS", subject_prefix="ctx.evt",
                            duplicate_window_s=600, poll_interval_s=1, batch_size=1, publish_timeout_s=5,
                            max_backoff_s=1)
        await step("persistence: ensure CTX_EVENTS", relay.ensure_stream())
        await step("persistence: publish an event", c["persistence"].nc.jetstream(timeout=5).publish(
            "ctx.evt.Probe", b"{}", headers={"Nats-Msg-Id": "e-1"}))
        # a turn's work-queue command, published by persistence right after the commit recording it
        await step("persistence: enqueue a turn command", c["persistence"].nc.jetstream(timeout=5).publish(
            "ctx.turn.run", b'{"turnId":"turn-2","conversationId":"conv-1"}', headers={"Nats-Msg-Id": "turn-2"}))

        # the MCP catalog's KV buckets (real adapters)
        buckets = KvBuckets(lambda: c["mcp-catalog"].nc, tools="ctx_mcp_tools", leases="ctx_mcp_leases",
                            turns="ctx_mcp_turns", lease_ttl_s=60, turn_ttl_s=3600)
        tools, turns = KvToolCache(buckets), KvTurnStore(buckets)
        if not await step("mcp-catalog: tool cache ping", buckets.ping()):
            errors.append("mcp-catalog: the tool cache bucket is not usable")
        await step("mcp-catalog: tool cache get", tools.get("srv"))
        await step("mcp-catalog: tool cache delete", tools.delete("srv"))
        if not await step("mcp-catalog: lease", tools.try_lease("srv", "replica-1")) or \
                not await step("mcp-catalog: lease check", tools.leased("srv")):
            errors.append("mcp-catalog: could not take a warm-up lease")
        await step("mcp-catalog: lease release", tools.release("srv", "replica-1"))
        await step("mcp-catalog: turn state create", turns.update("turn-1", lambda cur: {"deferred": ["a"]}))
        await step("mcp-catalog: turn state update",
                   turns.update("turn-1", lambda cur: {**(cur or {}), "inspected": ["b"]}))
        if ((await step("mcp-catalog: turn state get", turns.get("turn-1"))) or {}).get("inspected") != ["b"]:
            errors.append("mcp-catalog: per-turn state did not round-trip")
        await c["mcp-catalog"].nc.publish("ctx.mcp.tools_changed", b"{}")

        # the platform's claim check (JetStream Object Store CTX_CLAIMS, real adapter): every service stores a
        # claim (a large request or reply) and reads and deletes one; several chunks, so the read streams
        from ctxbuild_platform.claims import CHUNK_BYTES, ClaimStore

        payload = secrets.token_bytes(CHUNK_BYTES * 2 + 1)
        for user in SOURCES:
            store = ClaimStore(c[user].nc)
            claim = await step(f"{user}: store a claim", store.put(payload))
            if claim is not None and await step(f"{user}: read a claim", store.take(claim)) != payload:
                errors.append(f"{user}: a claim did not round-trip through CTX_CLAIMS")

        for user, cl in c.items():
            errors += [f"{user}: {v}" for v in await cl.settle()]

        # and what must be refused
        refused = [("truncation", "pub", "ctx.persist.append"), ("compaction", "sub", "ctx.blob.put"),
                   ("blobstore", "pub", "ctx.evt.Forged"), ("orchestration-runner", "pub", "ctx.turn.run"),
                   ("persistence", "pub", "$JS.API.STREAM.DELETE.CTX_TURNS"), ("mcp-catalog", "sub", "ctx.persist.>"),
                   # nobody reads another's replies or blob transfers
                   ("truncation", "sub", "_INBOX.>"), ("compaction", "sub", f"{inbox_prefix('blobstore')}.>"),
                   ("orchestration", "sub", f"{inbox_prefix('orchestration-runner')}.*.*"),
                   ("mcp-catalog", "sub", "_INBOX.*.>")]
        for user, kind, subject in refused:
            cl = c[user]
            before = len(cl.violations)
            if kind == "pub":
                await cl.nc.publish(subject, b"{}")
            else:
                await cl.nc.subscribe(subject)
            await cl.settle()
            if len(cl.violations) == before:
                errors.append(f"{user} could {kind} {subject}: the permissions are too wide")
    return errors


def live_errors(values: dict[str, Any], nats_bin: str) -> list[str]:
    with nats_server(values, nats_bin) as (address, pw):
        return asyncio.run(_scenario(address, pw))
