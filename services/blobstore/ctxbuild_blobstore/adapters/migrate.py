"""The blob store's schema migrations (SQL files in ../migrations, schema `blobstore`), via the platform helper."""

from __future__ import annotations

from pathlib import Path

from ctxbuild_platform import migrations

SCHEMA = "blobstore"
MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def yoyo_url(database_url: str, schema: str = SCHEMA) -> str:
    return migrations.yoyo_url(database_url, schema)


async def apply_migrations(database_url: str, connect_timeout: float = 10.0) -> list[str]:
    return await migrations.apply_migrations(database_url, SCHEMA, MIGRATIONS_DIR, connect_timeout)
