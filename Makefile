# ctxbuild — a newcomer needs two commands: `make run` and `make test`. Both install what they need.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PYTHON ?= python3
UV_VERSION := 0.13.9
TOOLS := .tools
UV := $(TOOLS)/bin/uv
PY := .venv/bin/python
STACK_DIR ?= .stack
export UV_PYTHON_DOWNLOADS := never
export UV_PYTHON := $(PYTHON)

.PHONY: help sync up down status logs run demo test test-security test-chaos test-unit test-integration bench bench-pipeline bench-codec \
	bench-blobstore bench-eventstore bench-truncation bench-compaction bench-e2e bench-scale bench-tool-search bench-context bench-gateway check-schemas contracts check-contracts \
	lint clean k8s-validate images chromium test-ui ui-shots

help:  ## list targets
	@grep -E '^[a-z0-9-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

$(UV):
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)

.venv/.synced: $(UV) uv.lock pyproject.toml $(wildcard libs/*/pyproject.toml services/*/pyproject.toml)
	$(UV) sync --all-packages --locked
	@touch $@

sync: .venv/.synced  ## install the workspace (uv, locked)

up: sync  ## start NATS, Postgres, SeaweedFS and the six services (idempotent; a dead one comes back on its own port)
	$(PY) -m ctxbuild_devstack up --dir $(STACK_DIR)

down:  ## stop everything (services drain first)
	@if [ -x $(PY) ]; then $(PY) -m ctxbuild_devstack down --dir $(STACK_DIR); fi

status: sync  ## show each component and its readiness (exit 1 unless all nine are ready)
	$(PY) -m ctxbuild_devstack status --dir $(STACK_DIR)

logs: sync  ## tail every component's log (make logs NAME=blobstore for one)
	$(PY) -m ctxbuild_devstack logs $(NAME) --dir $(STACK_DIR)

run: up demo  ## the main job: bring the stack up and run the offline demo

demo: sync  ## run the offline demo against a running stack (MODEL=… for a real OpenAI-compatible model)
	$(PY) -m ctxbuild_orchestration.demo --dir $(STACK_DIR) $(if $(MODEL),--model $(MODEL))

test: sync lint chromium check-contracts k8s-validate test-security test-chaos  ## unit, contract, integration, end-to-end, attack and chaos tests on a real local stack
	@$(PY) -m pytest tests -m "not security and not chaos"; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: that is a broken suite, not a pass" >&2; exit 1; fi; \
	exit $$rc

test-security: sync  ## the attack tests (pytest -m security tests/security) → bench/results/security.json (attacks_accepted must be 0)
	@junit=$$(mktemp --suffix=.xml); \
	$(PY) -m pytest -m security tests/security --junitxml=$$junit; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no attack tests: that is a broken suite, not a pass" >&2; rc=1; fi; \
	$(PY) bench/security.py $$junit --out bench/results/security.json || rc=1; \
	rm -f $$junit; exit $$rc

test-chaos: sync  ## faults injected into real replayed turns (pytest -m chaos tests/chaos [CHAOS_ARGS=…]) → bench/results/chaos.json (must hold)
	@record=$$(mktemp --suffix=.json); rm -f $$record; \
	CTX_CHAOS_OUT=$$record $(PY) -m pytest -m chaos tests/chaos $(CHAOS_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no chaos tests: that is a broken suite, not a pass" >&2; rc=1; fi; \
	$(PY) bench/chaos.py $$record --out bench/results/chaos.json || rc=1; \
	rm -f $$record; exit $$rc

CHROMIUM ?= $(or $(CTX_CHROMIUM),/usr/bin/chromium)
chromium:  ## Debian's Chromium for the inspector's browser tests: installed (apt, as root) when it is missing
	@if [ ! -x $(CHROMIUM) ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing Debian's chromium for the inspector's browser tests"; \
			export DEBIAN_FRONTEND=noninteractive; \
			apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; } || exit 1; \
		else \
			echo "$(CHROMIUM) is missing and cannot be installed here (needs root and apt-get):" \
				"install Debian's chromium, or point CTX_CHROMIUM at a Chromium; the browser tests fail without it" >&2; \
			exit 1; \
		fi; \
	fi

test-ui: sync chromium  ## the context inspector (/ui) in a real browser: Playwright + Debian Chromium on a real stack
	$(PY) -m pytest tests/e2e/test_inspector_ui.py

ui-shots: sync chromium  ## screenshots of every inspector page (the demo conversation, a live turn) → bench/results/ui/*.png
	@mkdir -p bench/results/ui
	CTX_UI_SHOTS=bench/results/ui $(PY) -m pytest tests/e2e/test_inspector_ui.py
	@ls bench/results/ui/*.png

test-unit: sync  ## pure-logic tests only (no servers)
	$(PY) -m pytest tests/unit tests/contract

bench: bench-pipeline bench-codec bench-blobstore bench-eventstore bench-truncation bench-compaction bench-e2e bench-scale check-schemas bench-tool-search bench-context bench-gateway  ## every benchmark → bench/results/*.json

bench-pipeline: sync  ## one pipeline step (truncate + blob put + event append) vs bare NATS, 50 KB
	$(PY) bench/pipeline_step.py --out bench/results/pipeline_step.json

bench-codec: sync  ## codec lanes vs sha256 / orjson on 10 MB inputs
	$(PY) bench/codec.py --out bench/results/codec.json

bench-blobstore: sync  ## blob store put/get vs raw S3; fs_read on a 100 MB blob
	$(PY) bench/blobstore.py --out bench/results/blobstore.json

bench-eventstore: sync  ## event append vs raw asyncpg INSERT; events/s; outbox lag
	$(PY) bench/eventstore.py --out bench/results/eventstore.json

bench-truncation: sync  ## truncation service round trip vs NATS + blob put floor; MB/s with 1 and 2 replicas
	$(PY) bench/truncation.py --out bench/results/truncation.json

bench-compaction: sync  ## seed scenario with memoisation on/off; served tokens per step; real trajectory
	$(PY) bench/compaction.py --out bench/results/compaction.json

bench-e2e: sync  ## real trajectories through the full stack: served tokens, prefix stability, recovery, kills
	$(PY) bench/e2e.py --out bench/results/e2e.json

bench-context: sync  ## ctxbuild (3 summarizers) vs LangChain/deepagents context strategies on the real runs, W=32k/16k (CONTEXT_METRICS.md) → context.json + PNGs
	$(UV) sync --all-packages --locked --group bench
	$(PY) bench/context.py --out bench/results/context.json

bench-gateway: sync  ## the gateway's added latency vs the LiteLLM proxy (small request; 40-step client-tool conversation), served/raw tokens, read-back → gateway.json
	$(PY) bench/gateway.py --out bench/results/gateway.json

bench-scale: sync  ## no ceiling: 50 turns / 100 MB in one conversation, turn start at 1k vs 10k messages, event sizes
	$(PY) bench/scale.py --out bench/results/scale.json

bench-tool-search: sync  ## tool_search over the 181 real MCP tools: recall@k and MRR (lexical, semantic, fusion), p50/p99
	$(PY) bench/tool_search.py --out bench/results/tool_search.json

check-schemas: sync  ## wire-schema figures over the 14 real MCP catalogs (needs ../shared/data)
	$(PY) bench/schemas.py --out bench/results/schemas.json

contracts: sync  ## regenerate the pydantic models from contracts/, and contracts/asyncapi.json + openapi.json from the apps
	$(PY) libs/codec/codegen.py
	$(PY) -m ctxbuild_platform.gen_docs contracts

check-contracts: sync  ## fail if the generated models or contract documents drifted from contracts/ and the code
	$(PY) libs/codec/codegen.py --check
	$(PY) -m ctxbuild_platform.gen_docs contracts --check

k8s-validate: sync  ## render every Kubernetes overlay and component combination offline and validate them
	$(PY) infra/k8s/validate.py

IMAGE_PREFIX ?= ctxbuild
IMAGE_TAG ?= $(shell git rev-parse --short HEAD 2>/dev/null || echo dev)
IMAGE_SERVICES := orchestration truncation persistence blobstore compaction mcp_catalog
images:  ## build one image per service from the one Dockerfile (needs a Docker engine; IMAGE_PREFIX, IMAGE_TAG)
	@command -v docker >/dev/null || { echo "make images needs a Docker engine (docker CLI not found)" >&2; exit 1; }
	@for s in $(IMAGE_SERVICES); do \
		img=$(IMAGE_PREFIX)/$$(echo $$s | tr _ -):$(IMAGE_TAG); echo "== $$img"; \
		docker build --build-arg SERVICE=$$s -t $$img . || exit 1; \
	done

lint: sync  ## ruff over libs, services, tests, bench and infra (the rules: pyproject.toml [tool.ruff])
	$(PY) -m ruff check libs services tests bench infra

clean: down
	rm -rf $(STACK_DIR) .venv $(TOOLS)
