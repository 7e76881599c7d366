"""``python -m ctxbuild_platform.migrate <service>…``: apply services' schema migrations, then exit.

For a deploy step that runs before the services roll (the Kubernetes Job ``ctxbuild-migrate``): each service that
owns a Postgres schema keeps its yoyo SQL files in its own package (``ctxbuild_<service>/migrations``), so this
runs in that service's image, with that service's database role. The services still migrate at start-up under the
same advisory lock; after this they find nothing to apply.

Reads ``CTX_DATABASE_URL`` (or ``--database-url``). Prints one JSON line per service; exits 1 with the reason on
stderr if a service is unknown, not installed in this image, or its migrations fail; Postgres refusing
connections is retried until ``--wait-s`` (a Job may start before the database is up).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import DependencyUnavailable, InvalidPayload, NotFound, ServiceError

# services owning a Postgres schema: the schema is named after the service, the files live in its package
SCHEMA_OWNERS = ("blobstore", "persistence", "mcp_catalog")


class UnknownService(InvalidPayload):
    """Not a service that owns a schema."""


class NotInstalled(NotFound):
    """The service's package (and so its migration files) is not in this image."""


class MigrationFailed(ServiceError):
    """Postgres answered but a migration did not apply (SQL error, missing privilege)."""

    code = "migration-failed"


@dataclass(frozen=True)
class Target:
    service: str
    schema: str
    migrations_dir: Path


def resolve(name: str) -> Target:
    """``mcp-catalog`` or ``mcp_catalog`` → where its migrations are. Imports nothing of the service."""
    service = name.strip().replace("-", "_")
    if service not in SCHEMA_OWNERS:
        raise UnknownService(f"{name!r} owns no Postgres schema; known: {', '.join(SCHEMA_OWNERS)}")
    package = f"ctxbuild_{service}"
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise NotInstalled(f"{package} is not installed here: run the migration in the {service} image")
    migrations_dir = Path(next(iter(spec.submodule_search_locations))) / "migrations"
    if not any(migrations_dir.glob("*.sql")):
        raise NotInstalled(f"{package} has no migrations in {migrations_dir}")
    return Target(service, service, migrations_dir)


def migrate(target: Target, database_url: str, wait_s: float) -> list[str]:
    import psycopg

    from .migrations import apply_migrations_sync

    deadline = time.monotonic() + wait_s
    delay = 0.5
    while True:
        try:
            return apply_migrations_sync(database_url, target.schema, target.migrations_dir)
        except psycopg.OperationalError as exc:  # not reachable / not accepting yet: wait for it
            if time.monotonic() + delay > deadline:
                raise DependencyUnavailable(f"postgres: cannot migrate {target.schema}: {exc}".strip()) from exc
            print(json.dumps({"service": target.service, "waiting": str(exc).strip()[:200]}), file=sys.stderr)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
        except psycopg.Error as exc:
            raise MigrationFailed(f"{target.schema}: {type(exc).__name__}: {exc}".strip()) from exc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ctxbuild_platform.migrate",
                                     description="apply the schema migrations of one or more services and exit")
    parser.add_argument("services", nargs="+", metavar="service", help=f"one of {', '.join(SCHEMA_OWNERS)}")
    parser.add_argument("--database-url", default=os.environ.get("CTX_DATABASE_URL"),
                        help="PostgreSQL URL (default: $CTX_DATABASE_URL)")
    parser.add_argument("--wait-s", type=float, default=120.0,
                        help="how long to retry while Postgres refuses connections (default 120)")
    args = parser.parse_args(argv)
    if not args.database_url:
        parser.error("no database URL: set CTX_DATABASE_URL or pass --database-url")
    try:
        targets = [resolve(s) for s in args.services]
        for target in targets:
            applied = migrate(target, args.database_url, args.wait_s)
            print(json.dumps({"service": target.service, "schema": target.schema, "applied": applied}))
    except ServiceError as exc:
        print(f"migrate: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
