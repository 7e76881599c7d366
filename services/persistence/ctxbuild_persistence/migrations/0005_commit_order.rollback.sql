-- Back to position order: only correct again once the advisory append lock is back (the previous code).
DROP INDEX IF EXISTS persistence.events_commit_order_idx;
ALTER TABLE persistence.events DROP COLUMN IF EXISTS tx;
