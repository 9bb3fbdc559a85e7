-- Failed tasks kept as dead letters (celery_pgqueue's keep_failed, reason 'failed'):
-- the traceback beside the error, which holds "Type: message" as for consumer_error.
-- NULL for every other reason. A nullable column with no default changes only the
-- catalog: no rewrite, a brief ACCESS EXCLUSIVE lock. Code of the previous version
-- neither reads nor writes it.
ALTER TABLE {schema}.dead_letter ADD COLUMN traceback text;

-- An archive of failed tasks grows with every failure: `dead list --reason failed`
-- and `dead purge --older-than 7d` read it by reason and by age, not by queue.
CREATE INDEX dead_letter_reason_idx ON {schema}.dead_letter (reason, died_at);

CREATE INDEX dead_letter_died_idx ON {schema}.dead_letter (died_at);
