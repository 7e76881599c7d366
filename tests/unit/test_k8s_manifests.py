"""The Kubernetes deployment (infra/k8s) and the images: the rules `make k8s-validate` enforces hold for the real
overlays, and each rule, schema and NATS check fails on the mistake it exists for.

Renders use the local `kubectl kustomize` (offline); the schema checks run the same CLIs as `make k8s-validate`.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "infra/k8s"


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


sys.path.insert(0, str(K8S))
validate = _load("ctx_k8s_validate", K8S / "validate.py")
natsauth = _load("natsauth", K8S / "natsauth.py")


@pytest.fixture(scope="module")
def prod() -> list[dict[str, Any]]:
    return validate.kustomize(K8S / "overlays/prod")


@pytest.fixture(scope="module")
def dev() -> list[dict[str, Any]]:
    return validate.kustomize(K8S / "overlays/dev")


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def container(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return find(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]


# ------------------------------------------------------------------------------------------ the real overlays

def test_prod_overlay_satisfies_every_rule(prod):
    assert validate.check_render(prod) == []
    deployments = {d["metadata"]["name"] for d in prod if d["kind"] == "Deployment"}
    assert deployments == set(validate.SETTINGS) | {"otel-collector"}
    hpa = {d["spec"]["scaleTargetRef"]["name"] for d in prod if d["kind"] == "HorizontalPodAutoscaler"}
    keda = {d["spec"]["scaleTargetRef"]["name"] for d in prod if d["kind"] == "ScaledObject"}
    assert keda == {"orchestration-runner"}
    assert hpa == set(validate.SETTINGS) - keda
    pdbs = {d["metadata"]["name"] for d in prod if d["kind"] == "PodDisruptionBudget"}
    assert pdbs == deployments
    # every ctxbuild pod is isolated by the network policies
    policies = [d for d in prod if d["kind"] == "NetworkPolicy"]
    for w in (d for d in prod if d["kind"] in ("Deployment", "Job")):
        assert validate.egress_rules(w, policies) is not None, w["metadata"]["name"]


def test_dev_overlay_satisfies_every_rule(dev):
    assert validate.check_render(dev) == []
    assert all(d["spec"].get("replicas") == 1 for d in dev if d["kind"] == "Deployment")
    assert not [d for d in dev if d["kind"] in ("HorizontalPodAutoscaler", "ScaledObject", "NetworkPolicy")]


def test_nats_credentials_reach_the_url_only_with_the_auth_component(prod, dev):
    index = validate.Index(prod)
    env = validate.container_env(container(prod, "truncation"), index, [], "t")
    assert env["CTX_NATS_URL"] == ("nats://<secret:ctxbuild-nats-truncation/NATS_USER>:"
                                   "<secret:ctxbuild-nats-truncation/NATS_PASSWORD>@nats.nats.svc.cluster.local:4222")
    env = validate.container_env(container(dev, "truncation"), validate.Index(dev), [], "t")
    assert env["CTX_NATS_URL"] == "nats://nats.nats.svc.cluster.local:4222"
    assert find(prod, "ScaledObject", "orchestration-runner")["spec"]["triggers"][0]["metadata"]["account"] == \
        natsauth.ACCOUNT == validate.ACCOUNT


def test_every_schema_owner_is_migrated_by_the_job_in_its_own_image(prod):
    job = find(prod, "Job", validate.MIGRATE_JOB)["spec"]["template"]["spec"]["containers"]
    migrated = {c["command"][-1]: c for c in job}
    owners = {name for name, module in validate.SETTINGS.items()
              if "database_url" in validate.load_settings(module).model_fields}
    assert {n.replace("-", "_") for n in owners} == set(migrated) == set(_migrate().SCHEMA_OWNERS)
    for service, c in migrated.items():
        assert c["command"][:3] == ["python", "-m", "ctxbuild_platform.migrate"]
        assert c["image"].split(":")[0] == "ctxbuild/" + service.replace("_", "-")
        # the same database role as the service
        secret = next(e["valueFrom"]["secretKeyRef"]["name"] for e in c["env"] if e["name"] == "DB_USER")
        svc = next(e["valueFrom"]["secretKeyRef"]["name"] for e in container(prod, service.replace("_", "-"))["env"]
                   if e["name"] == "DB_USER")
        assert secret == svc


# --------------------------------------------------------------------------- each rule fails on its mistake

def _dep(docs, name):
    return find(docs, "Deployment", name)


def _unset_ro_fs(d):
    container(d, "truncation")["securityContext"]["readOnlyRootFilesystem"] = False


def _root(d):
    _dep(d, "blobstore")["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] = False


def _hpa_on_runner(d):
    hpa = copy.deepcopy(find(d, "HorizontalPodAutoscaler", "truncation"))
    hpa["metadata"]["name"] = "runner-cpu"
    hpa["spec"]["scaleTargetRef"]["name"] = "orchestration-runner"
    d.append(hpa)


def _short_grace(d):
    _dep(d, "orchestration")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 20


def _typo_setting(d):
    data = find(d, "ConfigMap", "persistence-config")["data"]
    data["CTX_DB_POOL_MAXSIZE"] = data.pop("CTX_DB_POOL_MAX_SIZE")


def _bad_value(d):
    find(d, "ConfigMap", "compaction-config")["data"]["CTX_SUMMARIZER"] = "abstractive"


def _no_s3_endpoint(d):
    c = container(d, "blobstore")
    c["env"] = [e for e in c["env"] if e["name"] != "CTX_S3_ENDPOINT"]


def _loopback(d):
    del find(d, "ConfigMap", "ctxbuild-common")["data"]["CTX_HTTP_HOST"]


def _unknown_secret(d):
    container(d, "compaction")["env"].append(
        {"name": "CTX_OPENAI_API_KEY", "valueFrom": {"secretKeyRef": {"name": "openai", "key": "key"}}})


def _service_selector(d):
    find(d, "Service", "persistence")["spec"]["selector"] = {"app.kubernetes.io/name": "persistance"}


def _pdb_on_one_replica(d):
    find(d, "HorizontalPodAutoscaler", "compaction")["spec"]["minReplicas"] = 1


def _replicas_under_hpa(d):
    _dep(d, "truncation")["spec"]["replicas"] = 3


def _postgres_for_truncation(d):
    find(d, "NetworkPolicy", "ctxbuild-postgres")["spec"]["podSelector"]["matchExpressions"][0]["values"].append(
        "truncation")


def _no_nats_egress(d):
    d.remove(find(d, "NetworkPolicy", "ctxbuild-nats"))


def _phase_label(d):
    del find(d, "ServiceAccount", validate.MIGRATE_JOB)["metadata"]["labels"]["ctxbuild.io/phase"]


def _nats_url_not_first(d):
    env = container(d, "mcp-catalog")["env"]
    env.append(env.pop(0))


def _keda_wrong_account(d):
    find(d, "ScaledObject", "orchestration-runner")["spec"]["triggers"][0]["metadata"]["account"] = "$G"


def _latest(d):
    container(d, "persistence")["image"] = "ctxbuild/persistence:latest"


def _no_limits(d):
    del container(d, "mcp-catalog")["resources"]["limits"]


def _liveness_on_readyz(d):
    container(d, "blobstore")["livenessProbe"]["httpGet"]["path"] = "/readyz"


MUTATIONS = [
    (_unset_ro_fs, "readOnlyRootFilesystem must be true"),
    (_root, "runAsNonRoot must be true"),
    (_hpa_on_runner, "never two autoscalers on one"),
    (_short_grace, "terminationGracePeriodSeconds 20 <"),
    (_typo_setting, "CTX_DB_POOL_MAXSIZE is not a setting"),
    (_bad_value, "setting summarizer:"),
    (_no_s3_endpoint, "setting s3_endpoint: Field required"),
    (_loopback, "the probes cannot reach the pod"),
    (_unknown_secret, "Secret openai key key, which is not a documented Secret key"),
    (_service_selector, "Service/persistence: selector matches 0 workloads"),
    (_pdb_on_one_replica, "may run 1 replica(s)"),
    (_replicas_under_hpa, "sets spec.replicas although HorizontalPodAutoscaler/truncation owns the count"),
    (_postgres_for_truncation, "Deployment/truncation: Postgres egress is open"),
    (_no_nats_egress, "cannot reach NATS"),
    (_phase_label, "must carry ctxbuild.io/phase=pre-deploy"),
    (_nats_url_not_first, "env[0] must be CTX_NATS_URL"),
    (_keda_wrong_account, "reads account $G but the runner's streams are in CTXBUILD"),
    (_latest, "must carry a version tag (not latest)"),
    (_no_limits, "resources.limits.cpu is not set"),
    (_liveness_on_readyz, "livenessProbe must be GET /healthz"),
]


@pytest.mark.parametrize(("mutate", "expected"), MUTATIONS, ids=[m.__name__.strip("_") for m, _ in MUTATIONS])
def test_a_broken_manifest_is_caught(prod, mutate, expected):
    docs = copy.deepcopy(prod)
    mutate(docs)
    errors = validate.check_render(docs)
    assert any(expected in e for e in errors), errors


# ----------------------------------------------------------------------------------------------- schemas

def _schema_errors(docs, tmp_path):
    return validate.schema_errors(docs, tmp_path)


def test_core_kinds_are_validated_strictly(prod, tmp_path):
    dep = copy.deepcopy(_dep(prod, "truncation"))
    dep["spec"]["replica"] = 2  # misspelt
    errors = _schema_errors([dep], tmp_path)
    assert any("'replica' was unexpected" in e for e in errors), errors


def test_scaledobject_is_validated_against_the_vendored_schema(prod, tmp_path):
    so = copy.deepcopy(find(prod, "ScaledObject", "orchestration-runner"))
    assert _schema_errors([so], tmp_path) == []
    so["spec"]["minReplicas"] = 2  # KEDA calls it minReplicaCount
    errors = _schema_errors([so], tmp_path)
    assert any("check-jsonschema ScaledObject" in e for e in errors), errors


def test_cnpg_cluster_is_validated_against_the_vendored_schema(prod, tmp_path):
    cluster = copy.deepcopy(find(prod, "Cluster", "ctxbuild-pg"))
    assert _schema_errors([cluster], tmp_path) == []
    cluster["spec"]["managed"]["roles"][0]["ensure"] = "exists"  # present | absent
    errors = _schema_errors([cluster], tmp_path)
    assert any("check-jsonschema Cluster" in e for e in errors), errors


def test_a_custom_resource_without_a_vendored_schema_is_refused(tmp_path):
    doc = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {"name": "x"}, "spec": {}}
    assert any("no vendored schema" in e for e in _schema_errors([doc], tmp_path))


def test_every_component_combination_is_planned():
    names = [r.name for r in validate.plan()]
    assert len(names) == len(validate.overlays()) + 2 ** len(validate.components())
    assert "base" in names and "base+" + "+".join(validate.components()) in names


# -------------------------------------------------------------------------------------------- NATS accounts

@pytest.mark.parametrize(("pattern", "subject", "hit"), [
    ("ctx.blob.>", "ctx.blob.put", True), ("ctx.blob.>", "ctx.blob", False), ("ctx.*.put", "ctx.blob.put", True),
    ("ctx.*", "ctx.blob.put", False), ("$JS.ACK.CTX_TURNS.turn-runner.>", "$JS.ACK.CTX_TURNS.turn-runner.1.2", True),
    ("ctx.turn.run", "ctx.turn.abort", False),
])
def test_subject_matching(pattern, subject, hit):
    assert natsauth.matches(pattern, subject) is hit


def _asyncapi():
    return json.loads((REPO / "contracts/asyncapi.json").read_text())


def test_the_accounts_cover_what_each_service_serves_and_calls():
    values = natsauth.load_values()
    assert natsauth.contract_errors(values, _asyncapi()) == []
    assert natsauth.source_errors(values) == []


def _edit_user(values, user, kind, fn):
    for u in values["config"]["merge"]["accounts"][natsauth.ACCOUNT]["users"]:
        if u["user"] == user:
            u["permissions"][kind]["allow"] = fn(u["permissions"][kind]["allow"])
    return values


def test_a_service_that_cannot_subscribe_to_its_subjects_is_caught():
    values = _edit_user(natsauth.load_values(), "blobstore", "subscribe", lambda a: ["_INBOX.>"])
    assert any("ctx.blob.put: served by blobstore" in e for e in natsauth.contract_errors(values, _asyncapi()))


def test_another_service_subscribing_to_a_subject_is_caught():
    values = _edit_user(natsauth.load_values(), "compaction", "subscribe", lambda a: [*a, "ctx.persist.>"])
    assert any("NATS user compaction may subscribe" in e for e in natsauth.contract_errors(values, _asyncapi()))


def test_a_call_the_permissions_forbid_is_caught():
    values = _edit_user(natsauth.load_values(), "compaction", "publish",
                        lambda a: [s for s in a if s != "ctx.persist.>"])
    errors = natsauth.source_errors(values)
    assert "compaction calls ctx.persist.history (in its source) but may not publish to it" in errors


def test_a_notice_family_needs_its_per_turn_subjects():
    """A family's literal (``ctx.turn.ended``) is sent as ``ctx.turn.ended.<turnId>``: persistence (the closing
    commit's end notice) needs the wildcard, not the bare prefix."""
    values = _edit_user(natsauth.load_values(), "persistence", "publish",
                        lambda a: [s.replace("ctx.turn.ended.>", "ctx.turn.ended") for s in a])
    errors = natsauth.source_errors(values)
    assert "persistence calls ctx.turn.ended (in its source) but may not publish to it" in errors


def test_each_service_subscribes_only_to_its_own_inboxes(prod):
    assert natsauth.inbox_errors(natsauth.load_values()) == []
    index = validate.Index(prod)
    for user in natsauth.SOURCES:  # the component connects each Deployment with the prefix its user may read
        env = validate.container_env(container(prod, user), index, [], user)
        assert env["CTX_NATS_INBOX_PREFIX"] == natsauth.inbox_prefix(user) == f"_INBOX.{user}"


def test_a_user_reading_every_inbox_is_caught():
    values = _edit_user(natsauth.load_values(), "truncation", "subscribe", lambda a: [*a, "_INBOX.>"])
    assert "truncation may subscribe to _INBOX.>: other services' replies (only _INBOX.truncation.> is its own)" \
        in natsauth.inbox_errors(values)
    values = _edit_user(natsauth.load_values(), "compaction", "subscribe",
                        lambda a: [x.replace("_INBOX.compaction.>", "_INBOX.blobstore.>") for x in a])
    errors = natsauth.inbox_errors(values)
    assert "compaction may not subscribe to its own inboxes _INBOX.compaction.>" in errors
    assert any(e.startswith("compaction may subscribe to _INBOX.blobstore.>") for e in errors)


def test_a_deployment_with_another_inbox_prefix_is_caught(prod):
    d = copy.deepcopy(prod)
    env = container(d, "blobstore")["env"]
    next(e for e in env if e["name"] == "CTX_NATS_INBOX_PREFIX")["value"] = "_INBOX"
    assert any("CTX_NATS_INBOX_PREFIX must be _INBOX.blobstore" in e for e in validate.check_render(d))


def test_the_server_config_keeps_passwords_as_variables():
    conf = natsauth.nats_conf(natsauth.load_values(), port=4222, store_dir="/data")
    assert '"password": $CTX_NATS_BLOBSTORE' in conf
    assert "<<" not in conf
    assert set(natsauth.password_vars(natsauth.load_values())) == set(natsauth.SOURCES) | {"sys"}


def test_the_helm_env_provides_every_password_variable():
    values = natsauth.load_values()
    assert set(natsauth.password_vars(values).values()) == set(values["container"]["env"])


# ------------------------------------------------------------------------------------------------- images

SERVICES = sorted(p.parent.name for p in (REPO / "services").glob("*/pyproject.toml"))


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


DOCKERFILE = REPO / "Dockerfile"
MAKEFILE_IMAGES = re.search(r"^IMAGE_SERVICES := (.+)$", (REPO / "Makefile").read_text(), re.MULTILINE).group(1).split()


def test_one_pinned_multi_stage_non_root_image_file_serves_every_service():
    ins = _instructions(DOCKERFILE)
    args = dict(a.split("=", 1) for op, a in ins if op == "ARG" and "=" in a)
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", args["PYTHON_IMAGE"])
    froms = [a for op, a in ins if op == "FROM"]
    assert len(froms) >= 2 and all(f.startswith("${PYTHON_IMAGE}") for f in froms)
    sync = next(a for op, a in ins if op == "RUN" and "uv sync" in a)
    assert '--package "ctxbuild-$(echo "${SERVICE}" | tr _ -)" ' in sync
    assert "--frozen" in sync and "--no-dev" in sync and "--no-editable" in sync
    final = ins[max(i for i, (op, _) in enumerate(ins) if op == "FROM"):]
    user = next(a for op, a in final if op == "USER")
    assert re.fullmatch(r"[1-9]\d*(:[1-9]\d*)?", user), user
    assert any(op == "HEALTHCHECK" and "/healthz" in a for op, a in final)
    assert any(op == "ENV" and "CTX_IMAGE_MODULE=ctxbuild_${SERVICE}" in a for op, a in final)
    entry = json.loads(next(a for op, a in final if op == "ENTRYPOINT"))
    assert entry[:2] == ["/bin/sh", "-c"] and entry[2] == 'exec python -m "$CTX_IMAGE_MODULE" "$@"', entry
    assert not list((REPO / "services").glob("*/Dockerfile")), "one Dockerfile for every service"


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_builds_from_the_one_dockerfile(service):
    """``--build-arg SERVICE=<service>`` installs the package named ctxbuild-<service> and runs its module."""
    package = re.search(r'^name = "([^"]+)"', (REPO / "services" / service / "pyproject.toml").read_text(),
                        re.MULTILINE).group(1)
    assert package == "ctxbuild-" + service.replace("_", "-")
    assert (REPO / "services" / service / f"ctxbuild_{service}" / "__main__.py").exists()
    assert service in MAKEFILE_IMAGES


def test_mcp_catalog_image_has_git_for_its_stdio_servers():
    run = next(a for op, a in _instructions(DOCKERFILE) if op == "RUN" and "apt-get install" in a)
    assert 'mcp_catalog) packages="git"' in run


def test_every_image_in_the_manifests_is_built_by_a_dockerfile(prod):
    images = {c["image"].split(":")[0] for d in prod if d["kind"] in ("Deployment", "Job")
              for c in d["spec"]["template"]["spec"]["containers"] if c["image"].startswith("ctxbuild/")}
    assert images == {f"ctxbuild/{s.replace('_', '-')}" for s in SERVICES}


# ------------------------------------------------------------------------------------------------ migrate

def _migrate():
    from ctxbuild_platform import migrate

    return migrate


@pytest.mark.parametrize("name", ["blobstore", "persistence", "mcp_catalog", "mcp-catalog"])
def test_migrate_finds_each_schema_owner_where_its_service_applies_them(name):
    target = _migrate().resolve(name)
    service = name.replace("-", "_")
    adapters = {"blobstore": "ctxbuild_blobstore.adapters.migrate", "persistence": "ctxbuild_persistence.adapters.db",
                "mcp_catalog": "ctxbuild_mcp_catalog.adapters.registry"}[service]
    module = importlib.import_module(adapters)
    assert target.schema == module.SCHEMA
    assert target.migrations_dir.resolve() == module.MIGRATIONS_DIR.resolve()


def test_migrate_refuses_a_service_without_a_schema():
    with pytest.raises(_migrate().UnknownService, match="owns no Postgres schema"):
        _migrate().resolve("truncation")
