# syntax=docker/dockerfile:1
# One image per ctxbuild service, from one file: SERVICE is the directory under services/ (orchestration,
# truncation, persistence, blobstore, compaction, mcp_catalog). Build from the repository root (the uv workspace),
# e.g. `make images` or
#   docker build --build-arg SERVICE=blobstore -t ctxbuild/blobstore:TAG .
# Pinned base: a Python patch release; pin its digest too in CI (--build-arg PYTHON_IMAGE=…@sha256:…).
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
ARG SERVICE

FROM ${PYTHON_IMAGE} AS build
ARG SERVICE
ENV UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy UV_PYTHON_DOWNLOADS=never UV_PROJECT_ENVIRONMENT=/app/.venv \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install --no-cache-dir uv==0.13.9
WORKDIR /src
# uv needs the whole workspace to read the lock; it installs only the service's package (ctxbuild-<service>, `_`
# spelled `-`) and what it depends on (workspace libs as wheels, --no-editable), so the image holds this service's
# dependencies and no others
COPY pyproject.toml uv.lock ./
COPY libs libs
COPY services services
RUN --mount=type=cache,target=/root/.cache/uv \
    test -f "services/${SERVICE}/pyproject.toml" \
        || { echo "--build-arg SERVICE=<a directory of services/> is required (got '${SERVICE}')" >&2; exit 1; } \
    && uv sync --frozen --no-dev --no-editable --package "ctxbuild-$(echo "${SERVICE}" | tr _ -)" \
        --python /usr/local/bin/python3.11

FROM ${PYTHON_IMAGE}
ARG SERVICE
# what a service runs besides Python: mcp_catalog starts stdio MCP servers as child processes — the Python ones
# installed with it (mcp-server-time, mcp-server-git) need only this interpreter, mcp-server-git also needs git.
# Node/npx or uvx servers are not in the image: add their runtime in an image FROM this one, or run them as HTTP
# MCP servers (docs/deploy.md). The other services need nothing more.
RUN case "${SERVICE}" in mcp_catalog) packages="git" ;; *) packages="" ;; esac \
    && if [ -n "${packages}" ]; then \
        apt-get update && apt-get install -y --no-install-recommends ${packages} && rm -rf /var/lib/apt/lists/*; \
    fi
RUN groupadd --system --gid 10001 ctxbuild \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin ctxbuild
COPY --from=build /app/.venv /app/.venv
# the JSON Schemas every request and reply is checked against
COPY contracts /app/contracts
# read-only root filesystem in the pod: nothing writes outside /tmp (an emptyDir there); bytecode is precompiled
ENV PATH=/app/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    CTX_CONTRACTS_DIR=/app/contracts \
    CTX_HTTP_HOST=0.0.0.0 \
    CTX_HTTP_PORT=8080 \
    CTX_IMAGE_MODULE=ctxbuild_${SERVICE}
USER 10001:10001
EXPOSE 8080
# liveness: the process answers; readiness (/readyz: broker + own stores) is for the orchestrator, not this check
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ['CTX_HTTP_PORT'], timeout=2)"]
# `python -m ctxbuild_<service>` (an exec-form ENTRYPOINT cannot expand a variable, so the shell does it and
# execs: python is PID 1 and handles SIGTERM → drain (CTX_DRAIN_TIMEOUT_S) → exit 0; container args pass through)
ENTRYPOINT ["/bin/sh", "-c", "exec python -m \"$CTX_IMAGE_MODULE\" \"$@\"", "ctxbuild"]
