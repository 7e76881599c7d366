"""`make k8s-validate`: render every overlay and every combination of components offline, then validate.

1. yamllint over infra/k8s (manifests, components, Helm values).
2. `kubectl kustomize` of each overlay and of base + every subset of components/ (each component must stand on
   its own and with any other).
3. Schemas: core kinds with `kubernetes-validate --strict` at the oldest and newest Kubernetes we support, custom
   resources (KEDA ScaledObject, CloudNativePG Cluster) with `check-jsonschema` and the vendored schemas.
4. Rules (``check_render``) a schema cannot express: each service's settings validate from what its manifest
   gives it (the service's own pydantic Settings, secrets replaced by samples), probes, drain vs grace period,
   security context, resources, references between objects, one autoscaler per Deployment, disruption budgets
   that can be satisfied, network reach (NATS for all, Postgres/S3 only for their owners), the migration Job's
   pre-deploy phase.
5. The NATS accounts file: nats-server parses it; its permissions cover what each service serves and calls, and
   a live nats-server with it passes each service's real calls and refuses the rest (natsauth.py).

Offline and quick (a few seconds): no cluster, no network, no Helm.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import itertools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BIN = Path(sys.executable).parent
KUBE_VERSIONS = ("1.31.0", "1.37.0")  # oldest supported (preStop sleep, matchLabelKeys) and newest
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): HERE / "schemas/keda.sh/scaledobject_v1alpha1.json",
    ("postgresql.cnpg.io/v1", "Cluster"): HERE / "schemas/postgresql.cnpg.io/cluster_v1.json",
}
# workload (app.kubernetes.io/name) → the module of its pydantic Settings
SETTINGS = {
    "orchestration": "ctxbuild_orchestration.settings", "orchestration-runner": "ctxbuild_orchestration.settings",
    "truncation": "ctxbuild_truncation.settings", "persistence": "ctxbuild_persistence.settings",
    "blobstore": "ctxbuild_blobstore.settings", "compaction": "ctxbuild_compaction.settings",
    "mcp-catalog": "ctxbuild_mcp_catalog.settings",
}
MIGRATE_JOB = "ctxbuild-migrate"
# Secrets the operator creates (docs/deploy.md lists the same): name → keys. A reference to anything else fails.
EXTERNAL_SECRETS: dict[str, set[str]] = {
    "ctxbuild-s3": {"endpoint", "access-key", "secret-key", "bucket", "region"},
    "ctxbuild-llm": {"openai-api-key", "anthropic-api-key"},
    "ctxbuild-auth": {"admin-api-key"},
    **{f"ctxbuild-pg-{s}": {"username", "password"} for s in ("blobstore", "persistence", "mcp-catalog")},
    **{f"ctxbuild-nats-{s}": {"NATS_USER", "NATS_PASSWORD"} for s in SETTINGS},
}
PHASE = ("ctxbuild.io/phase", "pre-deploy")
ACCOUNT = "CTXBUILD"  # the NATS account of dependencies/nats/values-auth.yaml
WORKLOADS = ("Deployment", "Job")
S3_PORTS = {443, 9000, 8333}


def tool(name: str) -> str:
    path = BIN / name
    return str(path) if path.exists() else name


# --------------------------------------------------------------------------------------------------- render

@dataclass(frozen=True)
class Render:
    name: str
    components: tuple[str, ...]
    overlay: Path | None = None


def components() -> list[str]:
    return sorted(p.name for p in (HERE / "components").iterdir() if (p / "kustomization.yaml").exists())


def overlays() -> list[str]:
    return sorted(p.name for p in (HERE / "overlays").iterdir() if (p / "kustomization.yaml").exists())


def plan() -> list[Render]:
    out = [Render(f"overlays/{o}", (), HERE / "overlays" / o) for o in overlays()]
    comps = components()
    for n in range(len(comps) + 1):
        for combo in itertools.combinations(comps, n):
            out.append(Render("base" + "".join(f"+{c}" for c in combo), combo))
    return out


def kustomize(path: Path) -> list[dict[str, Any]]:
    proc = subprocess.run([tool("kubectl"), "kustomize", str(path)], capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RenderError(proc.stderr.strip())
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


class RenderError(Exception):
    pass


def render(r: Render, scratch: Path) -> list[dict[str, Any]]:
    if r.overlay is not None:
        return kustomize(r.overlay)
    d = Path(tempfile.mkdtemp(dir=scratch))
    def rel(p: Path) -> str:  # kustomize refuses absolute paths
        return os.path.relpath(p, d)

    (d / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [rel(HERE / "base")], "components": [rel(HERE / "components" / c) for c in r.components]}))
    return kustomize(d)


# ---------------------------------------------------------------------------------------------------- rules

def labels_match(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels + matchExpressions) against a label set; an empty selector matches all."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def pod_labels(obj: dict[str, Any]) -> dict[str, str]:
    return obj["spec"]["template"]["metadata"].get("labels") or {}


def app_name(obj: dict[str, Any]) -> str:
    return pod_labels(obj).get("app.kubernetes.io/name", obj["metadata"]["name"])


SECRET_TOKEN = re.compile(r"<secret:([^>]+)>")
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined variables are replaced, others stay as written; $$ escapes."""
    out, i = [], 0
    while i < len(value):
        if value.startswith("$$", i):
            out.append("$")
            i += 2
            continue
        m = VAR_REF.match(value, i)
        if m and m.group(1) in env:
            out.append(env[m.group(1)])
            i = m.end()
            continue
        out.append(value[i])
        i += 1
    return "".join(out)


def container_env(c: dict[str, Any], objs: Index, errors: list[str], where: str) -> dict[str, str]:
    """The environment a container starts with; secret values are ``<secret:name/key>`` tokens."""
    env: dict[str, str] = {}
    for src in c.get("envFrom") or []:
        if "configMapRef" in src:
            cm = objs.get("ConfigMap", src["configMapRef"]["name"])
            if cm is None:
                if not src["configMapRef"].get("optional"):
                    errors.append(f"{where}: envFrom ConfigMap {src['configMapRef']['name']} is not in the render")
                continue
            for k, v in (cm.get("data") or {}).items():
                env[src.get("prefix", "") + k] = str(v)
        elif "secretRef" in src:
            name = src["secretRef"]["name"]
            if name not in EXTERNAL_SECRETS:
                errors.append(f"{where}: envFrom Secret {name} is not a documented Secret")
                continue
            for k in EXTERNAL_SECRETS[name]:
                env[src.get("prefix", "") + k] = f"<secret:{name}/{k}>"
    for e in c.get("env") or []:
        if "value" in e:
            env[e["name"]] = expand(str(e["value"]), env)
            continue
        ref = e.get("valueFrom") or {}
        if "secretKeyRef" in ref:
            s = ref["secretKeyRef"]
            if s["key"] not in EXTERNAL_SECRETS.get(s["name"], ()):
                errors.append(f"{where}: env {e['name']} reads Secret {s['name']} key {s['key']}, which is not a "
                              "documented Secret key")
            elif not s.get("optional"):
                env[e["name"]] = f"<secret:{s['name']}/{s['key']}>"
        elif "configMapKeyRef" in ref:
            s = ref["configMapKeyRef"]
            cm = objs.get("ConfigMap", s["name"])
            if cm is None or s["key"] not in (cm.get("data") or {}):
                if not s.get("optional"):
                    errors.append(f"{where}: env {e['name']} reads ConfigMap {s['name']} key {s['key']}: missing")
            else:
                env[e["name"]] = str(cm["data"][s["key"]])
        else:
            env[e["name"]] = "<field>"
    return env


def _sample(settings_cls: Any, env_name: str, value: str) -> str:
    """A stand-in for secret material that has the shape the setting's type expects."""
    if SECRET_TOKEN.fullmatch(value):
        info = settings_cls.model_fields.get(env_name[len("CTX_"):].lower())
        if info is not None and re.search(r"Url|Dsn", repr(info.annotation)):
            return "https://secret.example.com"
    return SECRET_TOKEN.sub("secret", value)


def load_settings(module: str) -> Any:
    return importlib.import_module(module).Settings


def process_env_vars() -> set[str]:
    """CTX_ variables the code reads outside any Settings class (e.g. CTX_CONTRACTS_DIR)."""
    global _process_env
    if _process_env is None:
        pattern = re.compile(r"""environ(?:\.get\(|\[)\s*["'](CTX_[A-Z0-9_]+)["']""")
        _process_env = {m for root in ("libs", "services") for py in (REPO / root).rglob("*.py")
                        if "tests" not in py.parts for m in pattern.findall(py.read_text())}
    return _process_env


_process_env: set[str] | None = None


@contextlib.contextmanager
def only_env(env: dict[str, str]) -> Iterator[None]:
    with mock.patch.dict(os.environ, env, clear=True):
        yield


def check_settings(name: str, env: dict[str, str], where: str) -> tuple[list[str], Any]:
    """The service's own Settings, built from exactly this environment. Returns (errors, settings or None)."""
    key = (name, tuple(sorted(env.items())), where)
    if key not in _settings_cache:  # the 66 renders repeat the same few environments
        _settings_cache[key] = _check_settings(name, env, where)
    errors, settings = _settings_cache[key]
    return list(errors), settings


_settings_cache: dict[tuple[Any, ...], tuple[list[str], Any]] = {}


def _check_settings(name: str, env: dict[str, str], where: str) -> tuple[list[str], Any]:
    from pydantic import ValidationError

    cls = load_settings(SETTINGS[name])
    errors = []
    known = {f"CTX_{f.upper()}" for f in cls.model_fields} | process_env_vars()
    for var in sorted(v for v in env if v.startswith("CTX_") and v not in known):
        errors.append(f"{where}: {var} is not a setting of {SETTINGS[name]} (typo? it would be ignored)")
    unresolved = sorted(v for v, val in env.items() if v.startswith("CTX_") and VAR_REF.search(val))
    for var in unresolved:
        errors.append(f"{where}: {var} = {env[var]!r} refers to a variable not defined before it")
    sample = {k: _sample(cls, k, v) for k, v in env.items()}
    try:
        with only_env(sample):
            settings = cls()
    except ValidationError as exc:
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            errors.append(f"{where}: setting {loc}: {err['msg']} (from the manifest's environment)")
        return errors, None
    return errors, settings


class Index:
    def __init__(self, docs: list[dict[str, Any]]) -> None:
        self.docs = docs
        self.by_key = {(d["kind"], d["metadata"]["name"]): d for d in docs}

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        return self.by_key.get((kind, name))

    def kind(self, *kinds: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] in kinds]


def quantity(q: Any) -> float:
    s = str(q)
    units = {"m": 1e-3, "Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40, "k": 1e3, "M": 1e6, "G": 1e9}
    for u, f in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if s.endswith(u):
            return float(s[: -len(u)]) * f
    return float(s)


def check_container_basics(c: dict[str, Any], where: str) -> list[str]:
    errors = []
    sc = c.get("securityContext") or {}
    if sc.get("allowPrivilegeEscalation") is not False:
        errors.append(f"{where}: securityContext.allowPrivilegeEscalation must be false")
    if sc.get("readOnlyRootFilesystem") is not True:
        errors.append(f"{where}: securityContext.readOnlyRootFilesystem must be true")
    if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
        errors.append(f"{where}: securityContext.capabilities.drop must contain ALL")
    res = c.get("resources") or {}
    for kind in ("requests", "limits"):
        for r in ("cpu", "memory"):
            if r not in (res.get(kind) or {}):
                errors.append(f"{where}: resources.{kind}.{r} is not set")
    for r in ("cpu", "memory"):
        req, lim = (res.get("requests") or {}).get(r), (res.get("limits") or {}).get(r)
        if req is not None and lim is not None and quantity(req) > quantity(lim):
            errors.append(f"{where}: resources.requests.{r} ({req}) is above the limit ({lim})")
    image = c.get("image", "")
    if "@" not in image and (":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest")):
        errors.append(f"{where}: image {image!r} must carry a version tag (not latest) or a digest")
    return errors


def http_port(c: dict[str, Any]) -> int | None:
    return next((p["containerPort"] for p in c.get("ports") or [] if p.get("name") == "http"), None)


def check_service_container(name: str, obj: dict[str, Any], c: dict[str, Any], objs: Index,
                            where: str) -> list[str]:
    errors: list[str] = []
    env = container_env(c, objs, errors, where)
    env_list = c.get("env") or []
    if not env_list or env_list[0]["name"] != "CTX_NATS_URL":
        errors.append(f"{where}: env[0] must be CTX_NATS_URL (components/nats-auth rewrites env[0])")
    errs, settings = check_settings(name, env, where)
    errors += errs
    # a per-service NATS user may subscribe only to its own inboxes (dependencies/nats/values-auth.yaml)
    user = re.search(r"<secret:ctxbuild-nats-([a-z0-9-]+)/NATS_USER>", env.get("CTX_NATS_URL", ""))
    if user and env.get("CTX_NATS_INBOX_PREFIX") != f"_INBOX.{user.group(1)}":
        errors.append(f"{where}: CTX_NATS_INBOX_PREFIX must be _INBOX.{user.group(1)} for NATS user {user.group(1)} "
                      f"(got {env.get('CTX_NATS_INBOX_PREFIX')!r}): it may subscribe to no other inboxes")
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"), ("startupProbe", "/healthz")):
        got = ((c.get(probe) or {}).get("httpGet") or {})
        if got.get("path") != path or got.get("port") != "http":
            errors.append(f"{where}: {probe} must be GET {path} on port http (got {got or 'none'})")
    if settings is None:
        return errors
    if settings.http_host != "0.0.0.0":
        errors.append(f"{where}: CTX_HTTP_HOST is {settings.http_host}: the probes cannot reach the pod")
    if settings.http_port != http_port(c):
        errors.append(f"{where}: CTX_HTTP_PORT {settings.http_port} is not the container port 'http' "
                      f"({http_port(c)})")
    spec = pod_spec(obj)
    grace = spec.get("terminationGracePeriodSeconds", 30)
    pre = (((c.get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {}).get("seconds", 0)
    drain = settings.drain_timeout_s
    # SIGTERM: uvicorn waits up to int(drain)+1 s for open HTTP requests, then FastStream drains NATS for up
    # to drain s; a preStop sleep comes first
    need = pre + int(drain) + 1 + math.ceil(drain) + 3
    if grace < need:
        errors.append(f"{where}: terminationGracePeriodSeconds {grace} < preStop {pre} + HTTP drain "
                      f"{int(drain) + 1} + NATS drain {drain} + 3 s margin = {need}")
    if settings.startup_timeout_s > 0:
        sp = c.get("startupProbe") or {}
        window = sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3)
        if window <= settings.startup_timeout_s:
            errors.append(f"{where}: startupProbe window {window} s does not cover CTX_STARTUP_TIMEOUT_S "
                          f"{settings.startup_timeout_s} s of dependency retries")
    return errors


def check_workload(obj: dict[str, Any], objs: Index) -> list[str]:
    kind, name = obj["kind"], obj["metadata"]["name"]
    where = f"{kind}/{name}"
    errors: list[str] = []
    spec = pod_spec(obj)
    psc = spec.get("securityContext") or {}
    if psc.get("runAsNonRoot") is not True:
        errors.append(f"{where}: securityContext.runAsNonRoot must be true")
    if (psc.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
        errors.append(f"{where}: securityContext.seccompProfile must be RuntimeDefault")
    if spec.get("automountServiceAccountToken") is not False:
        errors.append(f"{where}: automountServiceAccountToken must be false (no ctxbuild pod talks to the API)")
    sa = spec.get("serviceAccountName")
    if not sa or objs.get("ServiceAccount", sa) is None:
        errors.append(f"{where}: serviceAccountName {sa!r} is not in the render")
    for vol in spec.get("volumes") or []:
        if "configMap" in vol and objs.get("ConfigMap", vol["configMap"]["name"]) is None:
            errors.append(f"{where}: volume {vol['name']} mounts ConfigMap {vol['configMap']['name']}: missing")
        if "secret" in vol and vol["secret"]["secretName"] not in EXTERNAL_SECRETS:
            errors.append(f"{where}: volume {vol['name']} mounts Secret {vol['secret']['secretName']}: undocumented")
    labels = pod_labels(obj)
    for c in spec.get("containers", []) + spec.get("initContainers", []):
        cw = f"{where} container {c['name']}"
        errors += check_container_basics(c, cw)
        if kind == "Deployment" and app_name(obj) in SETTINGS:
            errors += check_service_container(app_name(obj), obj, c, objs, cw)
        elif kind == "Job":
            container_env(c, objs, errors, cw)
    if kind == "Deployment":
        tsc = spec.get("topologySpreadConstraints") or []
        if not tsc:
            errors.append(f"{where}: no topologySpreadConstraints: replicas could all land on one node")
        for t in tsc:
            if not labels_match(t.get("labelSelector"), labels):
                errors.append(f"{where}: a topologySpreadConstraint's labelSelector does not match its own pods")
        sel = obj["spec"]["selector"]
        if not labels_match(sel, labels):
            errors.append(f"{where}: spec.selector does not match the pod template's labels")
    return errors


def min_replicas(name: str, objs: Index) -> int:
    for hpa in objs.kind("HorizontalPodAutoscaler"):
        if hpa["spec"]["scaleTargetRef"]["name"] == name:
            return hpa["spec"].get("minReplicas", 1)
    for so in objs.kind("ScaledObject"):
        if so["spec"]["scaleTargetRef"]["name"] == name:
            return so["spec"].get("minReplicaCount", 0)
    dep = objs.get("Deployment", name)
    return dep["spec"].get("replicas", 1) if dep else 0


def egress_rules(obj: dict[str, Any], policies: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Egress rules that apply to a workload's pods; None = not isolated for egress (everything allowed)."""
    labels = pod_labels(obj)
    selecting = [p for p in policies if labels_match(p["spec"].get("podSelector"), labels)
                 and "Egress" in (p["spec"].get("policyTypes") or [])]
    if not selecting:
        return None
    return [r for p in selecting for r in p["spec"].get("egress") or []]


def reaches(rules: list[dict[str, Any]] | None, port: int, to: dict[str, str] | None = None) -> bool:
    if rules is None:
        return True
    for r in rules:
        ports = {p.get("port") for p in r.get("ports") or []}
        if ports and port not in ports:
            continue
        peers = r.get("to") or []
        if not peers:
            return True
        for peer in peers:
            if "ipBlock" in peer and to is None:
                return True
            if to is not None and "podSelector" in peer and labels_match(peer["podSelector"], to):
                return True
    return False


def check_network(objs: Index) -> list[str]:
    policies = objs.kind("NetworkPolicy")
    if not policies:
        return []
    errors = []
    for obj in objs.kind(*WORKLOADS):
        labels, where = pod_labels(obj), f"{obj['kind']}/{obj['metadata']['name']}"
        if not any(labels_match(p["spec"].get("podSelector"), labels) for p in policies):
            continue  # not isolated at all (e.g. only the collector's own policy is rendered): nothing to check
        deny = [p for p in policies if labels_match(p["spec"].get("podSelector"), labels)
                and set(p["spec"].get("policyTypes") or []) == {"Ingress", "Egress"}
                and not p["spec"].get("ingress") and not p["spec"].get("egress")]
        if not deny and app_name(obj) != "otel-collector":
            errors.append(f"{where}: network policies are on, but no default-deny selects these pods")
        rules = egress_rules(obj, policies)
        if not reaches(rules, 53, {"k8s-app": "kube-dns"}):
            errors.append(f"{where}: cannot resolve names (no egress to kube-dns:53)")
        name = app_name(obj)
        if name in SETTINGS:
            fields = load_settings(SETTINGS[name]).model_fields
            if not reaches(rules, 4222, {"app.kubernetes.io/name": "nats"}):
                errors.append(f"{where}: cannot reach NATS (4222)")
            owns_pg = "database_url" in fields
            if reaches(rules, 5432, {"cnpg.io/cluster": "ctxbuild-pg"}) != owns_pg:
                errors.append(f"{where}: Postgres egress is {'missing' if owns_pg else 'open'}, but the service "
                              f"{'owns' if owns_pg else 'owns no'} schema (its Settings)")
            if "s3_endpoint" in fields and not all(reaches(rules, p) for p in S3_PORTS):
                errors.append(f"{where}: cannot reach S3 on ports {sorted(S3_PORTS)}")
        if name == MIGRATE_JOB and not reaches(rules, 5432, {"cnpg.io/cluster": "ctxbuild-pg"}):
            errors.append(f"{where}: the migration cannot reach Postgres")
    return errors


def check_autoscaling(objs: Index) -> list[str]:
    errors = []
    targets: dict[str, list[str]] = {}
    for a in objs.kind("HorizontalPodAutoscaler", "ScaledObject"):
        ref = a["spec"]["scaleTargetRef"]
        where = f"{a['kind']}/{a['metadata']['name']}"
        targets.setdefault(ref["name"], []).append(where)
        dep = objs.get("Deployment", ref["name"])
        if dep is None:
            errors.append(f"{where}: scales Deployment {ref['name']}, which is not in the render")
            continue
        if "replicas" in dep["spec"]:
            errors.append(f"Deployment/{ref['name']}: sets spec.replicas although {where} owns the count "
                          "(every apply would reset it)")
        component = pod_labels(dep).get("app.kubernetes.io/component")
        if a["kind"] == "ScaledObject" and component != "runner":
            errors.append(f"{where}: lag-based scaling on {ref['name']} ({component}), which is not queue-driven")
        if a["kind"] == "HorizontalPodAutoscaler":
            if component == "runner":
                errors.append(f"{where}: CPU scaling on the queue-driven {ref['name']}: use KEDA on its lag")
            lo, hi = a["spec"].get("minReplicas", 1), a["spec"]["maxReplicas"]
            if lo > hi:
                errors.append(f"{where}: minReplicas {lo} > maxReplicas {hi}")
            for c in pod_spec(dep)["containers"]:
                if "cpu" not in ((c.get("resources") or {}).get("requests") or {}):
                    errors.append(f"{where}: CPU utilisation needs a CPU request on {ref['name']}/{c['name']}")
    errors += check_keda_account(objs)
    for name, by in targets.items():
        if len(by) > 1:
            errors.append(f"Deployment/{name}: scaled by {' and '.join(by)}: never two autoscalers on one")
    return errors


def check_keda_account(objs: Index) -> list[str]:
    """With per-service NATS users the streams live in the ctxbuild account; KEDA must look there."""
    runner = objs.get("Deployment", "orchestration-runner")
    if runner is None:
        return []
    env = container_env(pod_spec(runner)["containers"][0], objs, [], "")
    account = ACCOUNT if "@" in env.get("CTX_NATS_URL", "") else "$G"
    errors = []
    for so in objs.kind("ScaledObject"):
        for t in so["spec"]["triggers"]:
            if t["type"] == "nats-jetstream" and t["metadata"].get("account") != account:
                errors.append(f"ScaledObject/{so['metadata']['name']}: reads account {t['metadata'].get('account')}"
                              f" but the runner's streams are in {account} (components/nats-auth after keda?)")
    return errors


def check_references(objs: Index) -> list[str]:
    errors = []
    workloads = objs.kind(*WORKLOADS)
    for svc in objs.kind("Service"):
        sel = svc["spec"].get("selector") or {}
        hits = [w for w in workloads if labels_match({"matchLabels": sel}, pod_labels(w))]
        where = f"Service/{svc['metadata']['name']}"
        if len(hits) != 1:
            errors.append(f"{where}: selector matches {len(hits)} workloads (want exactly one)")
            continue
        names = {p.get("name") for c in pod_spec(hits[0])["containers"] for p in c.get("ports") or []}
        for p in svc["spec"]["ports"]:
            if isinstance(p.get("targetPort"), str) and p["targetPort"] not in names:
                owner = hits[0]["metadata"]["name"]
                errors.append(f"{where}: targetPort {p['targetPort']} is no named port of {owner}")
    for pdb in objs.kind("PodDisruptionBudget"):
        where = f"PodDisruptionBudget/{pdb['metadata']['name']}"
        hits = [w for w in objs.kind("Deployment") if labels_match(pdb["spec"]["selector"], pod_labels(w))]
        if len(hits) != 1:
            errors.append(f"{where}: selector matches {len(hits)} Deployments (want exactly one)")
            continue
        lo = min_replicas(hits[0]["metadata"]["name"], objs)
        if lo < 2:
            errors.append(f"{where}: {hits[0]['metadata']['name']} may run {lo} replica(s): a budget either blocks "
                          "node drains or allows a full outage")
        if "minAvailable" in pdb["spec"] and pdb["spec"]["minAvailable"] >= lo:
            errors.append(f"{where}: minAvailable {pdb['spec']['minAvailable']} >= {lo} replicas blocks drains")
    for np in objs.kind("NetworkPolicy"):
        sel = np["spec"].get("podSelector") or {}
        if sel and not any(labels_match(sel, pod_labels(w)) for w in workloads) \
                and pod_labels_unknown(np, objs):
            errors.append(f"NetworkPolicy/{np['metadata']['name']}: selects no pod of this render")
    return errors


def pod_labels_unknown(np: dict[str, Any], objs: Index) -> bool:
    """A policy may target pods of a component that is not rendered (the collector's egress rule)."""
    wanted = (np["spec"]["podSelector"].get("matchLabels") or {}).get("app.kubernetes.io/name")
    return wanted is None or objs.get("Deployment", wanted) is not None


def check_phase(objs: Index) -> list[str]:
    """Everything the migration Job needs is applied with it, before the services (ctxbuild.io/phase)."""
    job = objs.get("Job", MIGRATE_JOB)
    if job is None:
        return ["Job/ctxbuild-migrate is missing: migrations must run before the services roll"]
    need = [("ServiceAccount", pod_spec(job)["serviceAccountName"])]
    for c in pod_spec(job)["containers"]:
        need += [("ConfigMap", s["configMapRef"]["name"]) for s in c.get("envFrom") or [] if "configMapRef" in s]
    need += [("NetworkPolicy", p["metadata"]["name"]) for p in objs.kind("NetworkPolicy")
             if labels_match(p["spec"].get("podSelector"), pod_labels(job))]
    need += [("Cluster", c["metadata"]["name"]) for c in objs.kind("Cluster")]
    need += [("Namespace", n["metadata"]["name"]) for n in objs.kind("Namespace")]
    need.append(("Job", MIGRATE_JOB))
    errors = []
    for kind, name in need:
        obj = objs.get(kind, name)
        if obj is not None and (obj["metadata"].get("labels") or {}).get(PHASE[0]) != PHASE[1]:
            errors.append(f"{kind}/{name}: the migration Job needs it, so it must carry {PHASE[0]}={PHASE[1]}")
    return errors


def check_namespace(objs: Index) -> list[str]:
    errors = []
    for ns in objs.kind("Namespace"):
        if (ns["metadata"].get("labels") or {}).get("pod-security.kubernetes.io/enforce") != "restricted":
            errors.append(f"Namespace/{ns['metadata']['name']}: enforce the restricted Pod Security Standard")
    return errors


def check_render(docs: list[dict[str, Any]]) -> list[str]:
    objs = Index(docs)
    errors: list[str] = []
    seen: set[tuple[str, str]] = set()
    for d in docs:
        key = (d["kind"], d["metadata"]["name"])
        if key in seen:
            errors.append(f"{key[0]}/{key[1]}: defined twice")
        seen.add(key)
    for w in objs.kind(*WORKLOADS):
        errors += check_workload(w, objs)
    errors += check_autoscaling(objs)
    errors += check_references(objs)
    errors += check_network(objs)
    errors += check_phase(objs)
    errors += check_namespace(objs)
    return errors


# -------------------------------------------------------------------------------------------------- schemas

def doc_key(d: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def schema_errors(docs: Iterable[dict[str, Any]], scratch: Path) -> list[str]:
    core, custom, unknown = [], {}, []
    for d in docs:
        k = (d["apiVersion"], d["kind"])
        group = d["apiVersion"].split("/")[0] if "/" in d["apiVersion"] else ""
        if k in CRD_SCHEMAS:
            custom.setdefault(k, []).append(d)
        elif "." in group and not group.endswith(".k8s.io"):
            unknown.append(f"{d['kind']}/{d['metadata']['name']}: no vendored schema for {d['apiVersion']} "
                           f"(infra/k8s/schemas, validate.CRD_SCHEMAS)")
        else:
            core.append(d)
    core_file = scratch / "core.yaml"
    core_file.write_text(yaml.safe_dump_all(core, sort_keys=False))
    jobs = [(f"kubernetes-validate {v}",
             [tool("kubernetes-validate"), "--strict", "--quiet", "-k", v, str(core_file)]) for v in KUBE_VERSIONS
            if core]
    for (api, kind), items in custom.items():
        files = []
        for i, d in enumerate(items):
            f = scratch / f"{kind}-{i}-{d['metadata']['name']}.json"
            f.write_text(json.dumps(d))
            files.append(str(f))
        jobs.append((f"check-jsonschema {kind}",
                     [tool("check-jsonschema"), "--schemafile", str(CRD_SCHEMAS[(api, kind)]), *files]))
    if not jobs:
        return unknown
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        procs = list(pool.map(lambda j: subprocess.run(j[1], capture_output=True, text=True, check=False), jobs))
    errors = unknown
    for (label, _), proc in zip(jobs, procs, strict=True):
        out = (proc.stdout + proc.stderr).strip()
        # kubernetes-validate only warns about a kind it has no schema for: that is a failure here
        if proc.returncode or "ERROR" in out or "Couldn't find schema" in out:
            errors += [f"{label}: {line}" for line in out.splitlines() if line.strip()]
    return errors


# ---------------------------------------------------------------------------------------------------- main

@dataclass
class Report:
    renders: int = 0
    objects: int = 0
    errors: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - t0


def run(skip_nats_live: bool = False) -> Report:
    report = Report()
    with report.stage("yamllint"):
        proc = subprocess.run([tool("yamllint"), "--strict", "-c", str(HERE / ".yamllint.yaml"), str(HERE)],
                              capture_output=True, text=True, check=False)
    if proc.returncode:
        report.errors += [f"yamllint: {line}" for line in proc.stdout.splitlines() if line.strip()]
    renders = plan()
    unique: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="ctx-k8s-", dir=HERE) as tmp:
        scratch = Path(tmp)
        with report.stage("render"), ThreadPoolExecutor(max_workers=4) as pool:
            results = list(pool.map(lambda r: _render_safely(r, scratch), renders))
        with report.stage("rules"):
            for r, (docs, err) in zip(renders, results, strict=True):
                report.renders += 1
                if err:
                    report.errors.append(f"{r.name}: kustomize: {err}")
                    continue
                report.errors += [f"{r.name}: {e}" for e in check_render(docs)]
                for d in docs:
                    unique.setdefault(doc_key(d), d)
        report.objects = len(unique)
        with report.stage("schemas"):
            report.errors += schema_errors(unique.values(), scratch)
    with report.stage("nats"):
        report.errors += nats_errors(skip_live=skip_nats_live)
    return report


def _render_safely(r: Render, scratch: Path) -> tuple[list[dict[str, Any]], str | None]:
    try:
        return render(r, scratch), None
    except RenderError as exc:
        return [], str(exc)


def nats_errors(skip_live: bool = False) -> list[str]:
    sys.path.insert(0, str(HERE))
    import natsauth

    values = natsauth.load_values()
    errors = [f"nats accounts: {e}" for e in natsauth.contract_errors(
        values, json.loads((REPO / "contracts/asyncapi.json").read_text()))]
    errors += [f"nats accounts: {e}" for e in natsauth.source_errors(values)]
    errors += [f"nats accounts: {e}" for e in natsauth.inbox_errors(values)]
    with tempfile.TemporaryDirectory(prefix="ctx-nats-") as tmp:
        conf = Path(tmp) / "nats.conf"
        conf.write_text(natsauth.nats_conf(values, port=4222, store_dir=str(Path(tmp) / "js")))
        env = dict.fromkeys(natsauth.password_vars(values).values(), "x")
        proc = subprocess.run([tool("nats-server"), "-t", "-c", str(conf)], env=env, capture_output=True, text=True,
                              check=False)
        if proc.returncode:
            errors.append(f"nats accounts: nats-server rejects the config: {proc.stderr.strip()}")
            return errors
    if not skip_live:
        errors += [f"nats accounts (live): {e}" for e in natsauth.live_errors(values, tool("nats-server"))]
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-nats-live", action="store_true", help="no live nats-server permission check")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    import logging

    import structlog

    # the service adapters the NATS check drives log their stream creations: keep the output to findings
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    report = run(skip_nats_live=args.skip_nats_live)
    for e in report.errors:
        print(f"ERROR {e}")
    status = "FAILED" if report.errors else "ok"
    print(f"k8s-validate: {status}: {report.renders} renders ({', '.join(overlays())} + "
          f"{2 ** len(components())} component combinations), {report.objects} distinct objects, "
          f"{len(report.errors)} errors, {time.monotonic() - t0:.1f} s "
          f"({', '.join(f'{k} {v:.1f}' for k, v in report.seconds.items())})")
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
