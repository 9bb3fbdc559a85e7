-- Statements of the failed-task archive (celery_pgqueue's keep_failed) and of the dead
-- letter listing and trimming that reads it by reason and age. {schema} is composed
-- with psycopg.sql.Identifier; everything else is a %(named)s parameter.

-- name: bury_failed :one
-- A task that failed for good, into the dead letters with reason 'failed', its error
-- ("Type: message") and traceback. Sent by the process that ran the task, which knows
-- its delivery (message id and lease) from the task's request.
-- The content is the stored row while this delivery still holds it (late acks), else
-- the message as the worker rebuilt it from the task's request (early acks: the ack
-- deleted the row before the task ran). With %(move)s, the held row leaves the queue
-- here, because the worker rejects it next and that reject then finds nothing;
-- without, the row is copied and the worker's ack that follows deletes it, so an ack
-- never misses its row. A message that another delivery holds (this lease lapsed)
-- runs again there: nothing is written, no row returned. A dead letter of the same
-- message (rejected by the worker first, or kept by an earlier run) takes the failure.
WITH held AS (
    SELECT id, queue, priority, created_at, dedup_key, body, content_type,
           content_encoding, headers, properties
    FROM {schema}.message_store
    WHERE id = %(id)s
      AND lease = %(lease)s
),
moved AS (
    DELETE FROM {schema}.message_store
    WHERE %(move)s::boolean
      AND id = %(id)s
      AND lease = %(lease)s
    RETURNING id
),
kept AS (
    SELECT id, queue, priority, created_at, dedup_key, body, content_type,
           content_encoding, headers, properties
    FROM held
    UNION ALL
    SELECT %(id)s::bigint,
           %(queue)s::text,
           %(priority)s::smallint,
           now(),
           %(dedup_key)s::text,
           %(body)s::bytea,
           %(content_type)s::text,
           %(content_encoding)s::text,
           %(headers)s::json,
           %(properties)s::json
    WHERE NOT EXISTS (SELECT 1 FROM held)
      -- the statement's snapshot: a row here now has another lease
      AND NOT EXISTS (SELECT 1 FROM {schema}.message_store WHERE id = %(id)s)
)
INSERT INTO {schema}.dead_letter AS d (
    id, queue, priority, attempts, reason, error, traceback, created_at, dedup_key,
    body, content_type, content_encoding, headers, properties
)
SELECT id, queue, priority, %(attempts)s::integer, 'failed', %(error)s::text,
       %(traceback)s::text, created_at, dedup_key, body, content_type, content_encoding,
       headers, properties
FROM kept
ON CONFLICT (id) DO UPDATE
SET reason = excluded.reason,
    error = excluded.error,
    traceback = excluded.traceback,
    attempts = greatest(d.attempts, excluded.attempts),
    died_at = excluded.died_at
RETURNING id;

-- name: dead_letters_where :many
-- Dead letters of a queue and of a reason (NULL: any), oldest first, with the
-- traceback of a failed task.
SELECT id, queue, priority, attempts, reason, created_at, died_at,
       body, content_type, content_encoding, headers::text, properties::text, error,
       traceback
FROM {schema}.dead_letter
WHERE (%(queue)s::text IS NULL OR queue = %(queue)s)
  AND (%(reason)s::text IS NULL OR reason = %(reason)s)
ORDER BY died_at, id
LIMIT %(limit)s;

-- name: dead_letter_full :one
SELECT id, queue, priority, attempts, reason, created_at, died_at,
       body, content_type, content_encoding, headers::text, properties::text, error,
       traceback
FROM {schema}.dead_letter
WHERE id = %(id)s;

-- name: purge_dead_where :one
-- Delete dead letters of a queue, of a reason (NULL: any) and dead for longer than
-- %(older_than)s seconds (NULL: however long), as of %(now)s (NULL: the server's clock).
WITH purged AS (
    DELETE FROM {schema}.dead_letter
    WHERE (%(queue)s::text IS NULL OR queue = %(queue)s)
      AND (%(reason)s::text IS NULL OR reason = %(reason)s)
      AND (
          %(older_than)s::float8 IS NULL
          OR died_at < coalesce(%(now)s::timestamptz, now())
                       - make_interval(secs => %(older_than)s::float8)
      )
    RETURNING id
)
SELECT count(*)
FROM purged;
