"""I/O adapters: Postgres (asyncpg), S3 (minio in a thread), schema migrations (yoyo)."""
