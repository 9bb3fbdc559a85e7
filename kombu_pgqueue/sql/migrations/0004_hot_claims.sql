-- Claims, renewals and requeues become HOT updates: the new row version goes on the
-- same page and no index gets a new entry.
-- PostgreSQL updates a row in place (HOT) only when no indexed column changes value,
-- and the only index on next_iteration, which every claim moves, was
-- message_delayed_idx. That index now keys on due_at, a generated copy of
-- next_iteration that is NULL unless the message is delayed; a claim never touches a
-- delayed message, so due_at stays NULL and the update stays HOT. Being generated,
-- due_at is right whatever writes the row (an older pgqueue still running, a COPY).
--
-- A HOT update needs room on the row's own page. Each message is written twice (the
-- insert, then the claim's version) before the ack deletes it, so pages are filled
-- to half by inserts and the claim's version lands beside the original. Without an
-- old snapshot, pruning on the page frees both soon after the ack; with one (the
-- chaos "snapshot" scenario), nothing can be freed, and this keeps the claim's
-- versions out of the indexes and off pages the claim would otherwise have to read.
-- Set first, so the rewrite below lays out the rows already waiting the same way.
ALTER TABLE {schema}.message SET (fillfactor = 50);

-- Adding a stored generated column rewrites the table once, under the migration's
-- ACCESS EXCLUSIVE lock (see docs/operations.md before upgrading a big backlog).
ALTER TABLE {schema}.message
    ADD COLUMN due_at timestamptz
    GENERATED ALWAYS AS (CASE WHEN delayed THEN next_iteration END) STORED;

CREATE INDEX message_due_idx ON {schema}.message (due_at) WHERE delayed;

DROP INDEX {schema}.message_delayed_idx;
