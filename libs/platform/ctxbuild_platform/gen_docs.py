"""Generate contracts/asyncapi.json (all services' NATS subjects) and contracts/openapi.json (HTTP edge).

`python -m ctxbuild_platform.gen_docs contracts [--check]`. Each service's `__main__` exposes
`create_app()`; its broker's subscribers and its ``@rpc`` subjects' declarations (:func:`rpc.declarations`)
become AsyncAPI channels, and each channel's payload points at the
subject's JSON Schema contract so the document and the validation use the same schemas.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

SERVICES = ("blobstore", "persistence", "truncation", "compaction", "mcp_catalog", "orchestration")
# doc generation builds the apps without connecting; required settings get inert placeholders
PLACEHOLDER_ENV = {
    "CTX_NATS_URL": "nats://127.0.0.1:4222",
    "CTX_DATABASE_URL": "postgresql://placeholder@127.0.0.1:5432/placeholder",
    "CTX_S3_ENDPOINT": "http://127.0.0.1:8333",
    "CTX_S3_ACCESS_KEY": "placeholder",
    "CTX_S3_SECRET_KEY": "placeholder",
    "CTX_S3_BUCKET": "placeholder",
}


def _apps() -> dict[str, Any]:
    for k, v in PLACEHOLDER_ENV.items():
        os.environ.setdefault(k, v)
    apps = {}
    for svc in SERVICES:
        os.environ["CTX_SERVICE_NAME"] = svc
        apps[svc] = importlib.import_module(f"ctxbuild_{svc}.__main__").create_app()
    return apps


def _broker(app: Any) -> Any:
    broker = getattr(app, "broker", None)
    return broker if broker is not None else app.state.broker


def _brokers(app: Any) -> list[Any]:
    """The app's broker and, if it serves ``@rpc`` subjects, the broker declaring them."""
    from . import rpc

    broker = _broker(app)
    return [broker, rpc.declarations(broker)] if rpc.servers(broker) else [broker]


def asyncapi(apps: dict[str, Any], contracts: Path) -> dict[str, Any]:
    from faststream.specification import AsyncAPI

    spec = AsyncAPI(*[b for a in apps.values() for b in _brokers(a)], title="ctxbuild", version="0.1.0",
                    description="NATS subjects of the ctxbuild services. Payload schemas are the JSON Schemas "
                                "in this folder; every reply is contracts/common/reply.json.",
                    schema_version="3.0.0").to_specification().to_jsonable()
    for channel in spec.get("channels", {}).values():
        subject = channel.get("address", "")
        req, rep = contracts / "subjects" / f"{subject}.request.json", contracts / "subjects" / f"{subject}.reply.json"
        for msg in channel.get("messages", {}).values():
            # channel messages are $refs into components/messages: set the payload on the target
            ref = msg.get("$ref", "")
            if ref.startswith("#/components/messages/"):
                msg = spec["components"]["messages"][ref.removeprefix("#/components/messages/")]
            if req.exists():
                msg["payload"] = {"$ref": f"./subjects/{req.name}"}
            if rep.exists():
                msg["x-reply-payload"] = {"$ref": f"./subjects/{rep.name}"}
    _add_contract_only_subjects(spec, contracts)
    return spec


def _add_contract_only_subjects(spec: dict[str, Any], contracts: Path) -> None:
    """Subjects with a contract but no FastStream subscriber (the JetStream work queue pulled with nats-py, the
    per-turn text deltas) are documented from their contract, so the document lists every subject there is."""
    from .contracts import SUBJECT_FAMILIES

    served = {ch.get("address") for ch in spec.get("channels", {}).values()}
    for path in sorted((contracts / "subjects").glob("*.request.json")):
        subject = path.name.removesuffix(".request.json")
        if subject in served:
            continue
        schema = json.loads(path.read_text())
        address = subject + (".{turnId}" if subject in SUBJECT_FAMILIES else "")
        key = f"{subject}:Contract"
        spec.setdefault("channels", {})[key] = {
            "address": address, "description": schema.get("description", ""),
            "messages": {"Message": {"$ref": f"#/components/messages/{key}:Message"}},
            "servers": [{"$ref": "#/servers/development"}]}
        if subject in SUBJECT_FAMILIES:
            spec["channels"][key]["parameters"] = {"turnId": {"description": "the turn's id"}}
        spec.setdefault("components", {}).setdefault("messages", {})[f"{key}:Message"] = {
            "title": f"{key}:Message", "payload": {"$ref": f"./subjects/{path.name}"}}
        spec.setdefault("operations", {})[f"{key}:Send"] = {
            "action": "send", "channel": {"$ref": f"#/channels/{key}"},
            "messages": [{"$ref": f"#/channels/{key}/messages/Message"}]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--check", action="store_true", help="fail if the files differ from what the code generates")
    args = ap.parse_args(argv)
    apps = _apps()
    docs = {
        "asyncapi.json": asyncapi(apps, args.out),
        "openapi.json": apps["orchestration"].openapi(),
    }
    drift = []
    for name, doc in docs.items():
        text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                drift.append(name)
        else:
            path.write_text(text)
    if drift:
        print(f"generated contract documents are stale: {', '.join(drift)}; run `make contracts`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
