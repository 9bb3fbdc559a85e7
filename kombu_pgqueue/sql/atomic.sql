-- Statements of atomic tasks (kombu_pgqueue.atomic, celery_pgqueue.atomic). They run on
-- the application's connection, inside the task's own transaction, never on the broker's
-- pool: the task's writes and the ack of its delivery commit together, or not at all.

-- name: ack_in_transaction :one
-- The ack of one delivery, fenced by its lease as ack is. No synchronous_commit = off
-- here: the commit that deletes the row also holds the task's own writes. The row stays
-- locked until that transaction ends, so no claim takes it meanwhile (SKIP LOCKED); a
-- claim that locked it first and leased it anew makes this delete find nothing.
-- (function delete_delivery, migration 0013: the live generations only, see the top of
-- queries.sql)
SELECT %(id)s::bigint AS id
WHERE {schema}.delete_delivery(%(id)s, %(lease)s);

-- name: delivery_holder :one
-- Why an ack_in_transaction found nothing, for the log line: the row is gone (acked by
-- another delivery, purged, expired) or held by another lease, and since when.
SELECT
    lease IS NOT NULL AS leased,
    attempts,
    next_iteration > coalesce(%(now)s::timestamptz, now()) AS lease_live
FROM {schema}.message_store
WHERE id = %(id)s;
