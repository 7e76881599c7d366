"""I/O of the persistence service: Postgres (asyncpg pool, yoyo migrations, event store) and the outbox relay
to JetStream."""
