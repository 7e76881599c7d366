"""Pure logic of the persistence service: append planning (concurrency + idempotency) and folding a
conversation's events into messages, attachments and the path to an anchor. No I/O here."""
