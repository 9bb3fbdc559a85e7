-- Statements of atomic tasks (kombu_pgqueue.atomic, celery_pgqueue.atomic). They run on
-- the application's connection, inside the task's own transaction, never on the broker's
-- pool: the task's writes and the ack of its delivery commit together, or not at all.

-- name: ack_in_transaction :one
-- The ack of one delivery, fenced by its lease as ack is. No synchronous_commit = off
-- here: the commit that deletes the row also holds the task's own writes. The row stays
-- locked until that transaction ends, so no claim takes it meanwhile (SKIP LOCKED); a
-- claim that locked it first and leased it anew makes this delete find nothing.
DELETE FROM {schema}.message_store
WHERE id = %(id)s
  AND lease = %(lease)s
  -- the live generations only (see the top of queries.sql)
  AND gen BETWEEN (SELECT r.oldest FROM {schema}.rotation AS r)
              AND (SELECT s.last_value FROM {schema}.generation_seq AS s)
RETURNING id;

-- name: delivery_holder :one
-- Why an ack_in_transaction found nothing, for the log line: the row is gone (acked by
-- another delivery, purged, expired) or held by another lease, and since when.
SELECT
    lease IS NOT NULL AS leased,
    attempts,
    next_iteration > coalesce(%(now)s::timestamptz, now()) AS lease_live
FROM {schema}.message_store
WHERE id = %(id)s;
