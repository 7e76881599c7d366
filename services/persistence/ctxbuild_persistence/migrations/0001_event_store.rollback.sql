DROP TABLE IF EXISTS persistence.outbox;
DROP TABLE IF EXISTS persistence.events;
