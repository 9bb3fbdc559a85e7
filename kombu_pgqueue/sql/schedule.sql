-- Statements of the periodic task schedule (migration 0017): celery_pgqueue's beat
-- scheduler and the `celery pgqueue schedule` commands, through kombu_pgqueue.schedule.
-- {schema} is composed with psycopg.sql.Identifier; everything else is a %(named)s
-- parameter. Time is a parameter, so tests move it instead of sleeping.

-- name: periodic_entries :many
-- Every entry by name, or the enabled ones only (what a beat schedules).
SELECT name, task, schedule, args, kwargs, options, missed, enabled, origin, revision,
       last_due, last_run_at, total_run_count, late_count, last_lateness, created_at,
       updated_at
FROM {schema}.periodic_entry
WHERE enabled
   OR NOT %(enabled_only)s::boolean
ORDER BY name;

-- name: save_periodic :one
-- Add an entry or change it. A new entry's first due time is the first after now (as
-- Celery's own scheduler starts a new entry); a changed one keeps its last due time,
-- its run counts and whether it is paused, and takes a new revision, so a beat that
-- read the old one sends nothing with it. An unchanged one is left alone: every beat
-- syncs beat_schedule at its start, and that changes nothing the second time.
-- Returns the entry's revision and whether this statement wrote it.
WITH saved AS (
    INSERT INTO {schema}.periodic_entry AS e (
        name, task, schedule, args, kwargs, options, missed, origin, last_due,
        created_at, updated_at
    )
    VALUES (
        %(name)s::text,
        %(task)s::text,
        %(schedule)s::jsonb,
        %(args)s::jsonb,
        %(kwargs)s::jsonb,
        %(options)s::jsonb,
        %(missed)s::text,
        %(origin)s::text,
        coalesce(%(now)s::timestamptz, now()),
        coalesce(%(now)s::timestamptz, now()),
        coalesce(%(now)s::timestamptz, now())
    )
    ON CONFLICT (name) DO UPDATE
    SET task = excluded.task,
        schedule = excluded.schedule,
        args = excluded.args,
        kwargs = excluded.kwargs,
        options = excluded.options,
        missed = excluded.missed,
        origin = excluded.origin,
        revision = e.revision + 1,
        updated_at = excluded.updated_at
    WHERE (e.task, e.schedule, e.args, e.kwargs, e.options, e.missed, e.origin)
          IS DISTINCT FROM
          (excluded.task, excluded.schedule, excluded.args, excluded.kwargs,
           excluded.options, excluded.missed, excluded.origin)
    RETURNING e.revision
)
SELECT revision, true
FROM saved
UNION ALL
SELECT revision, false
FROM {schema}.periodic_entry
WHERE name = %(name)s::text
  AND NOT EXISTS (SELECT 1 FROM saved);

-- name: drop_config_periodic :many
-- The entries beat_schedule had and no longer has, at a beat's start. Entries added
-- at run time (origin 'runtime') are the CLI's and the admin API's, never removed here.
DELETE FROM {schema}.periodic_entry
WHERE origin = 'config'
  AND name <> ALL (%(names)s::text[])
RETURNING name;

-- name: pause_periodic :one
-- A paused entry sends nothing, even from a beat that read it before the pause: the
-- send's condition (fire_periodic) reads enabled in the row it updates.
UPDATE {schema}.periodic_entry
SET enabled = false,
    revision = revision + 1,
    updated_at = coalesce(%(now)s::timestamptz, now())
WHERE name = %(name)s::text
RETURNING name;

-- name: resume_periodic :one
-- A resumed entry starts again from now: the due times of its pause are not missed
-- ones, and none of them is sent.
UPDATE {schema}.periodic_entry
SET enabled = true,
    revision = revision + 1,
    last_due = greatest(last_due, coalesce(%(now)s::timestamptz, now())),
    updated_at = coalesce(%(now)s::timestamptz, now())
WHERE name = %(name)s::text
  AND NOT enabled
RETURNING name;

-- name: remove_periodic :one
DELETE FROM {schema}.periodic_entry
WHERE name = %(name)s::text
RETURNING name;

-- name: fire_periodic :one
-- Due time %(due)s of an entry, sent (%(send)s) or skipped, in the caller's
-- transaction: a send publishes in the same transaction, so the message and the moved
-- last_due commit together or not at all. The condition is the guard against a second
-- send of the same (entry, due time): another beat that sent it first moved last_due
-- to it, and this UPDATE, which waits for that beat's row lock, then finds the row no
-- longer matching. An entry paused or changed since the caller read it (another
-- revision) is not sent either. Returns nothing when the due time is not this
-- caller's to send.
UPDATE {schema}.periodic_entry
SET last_due = %(due)s::timestamptz,
    last_run_at = CASE WHEN %(send)s::boolean
                       THEN coalesce(%(now)s::timestamptz, now())
                       ELSE last_run_at END,
    total_run_count = total_run_count + (%(send)s::boolean)::integer,
    late_count = late_count
        + (%(send)s::boolean
           AND coalesce(%(now)s::timestamptz, now()) - %(due)s::timestamptz
               > make_interval(secs => %(late_after)s::double precision))::integer,
    last_lateness = CASE WHEN %(send)s::boolean
                         THEN extract(epoch FROM coalesce(%(now)s::timestamptz, now())
                                                 - %(due)s::timestamptz)::double precision
                         ELSE last_lateness END
WHERE name = %(name)s::text
  AND revision = %(revision)s::bigint
  AND enabled
  AND last_due < %(due)s::timestamptz
RETURNING name;

-- name: try_lead_beat :one
-- The beats' leadership: a session lock, kept until the session ends (the process
-- exits or dies, its connection breaks, or the server ends the session). Several
-- beats at once is safe (fire_periodic's guard) but wasteful; one leads.
SELECT pg_try_advisory_lock({lock_beat}, hashtext(%(schema)s::text));

-- name: note_beat_leader :none
INSERT INTO {schema}.periodic_leader AS l (one, node, backend_pid, since)
VALUES (true, %(node)s::text, pg_backend_pid(), coalesce(%(now)s::timestamptz, now()))
ON CONFLICT (one) DO UPDATE
SET node = excluded.node,
    backend_pid = excluded.backend_pid,
    since = excluded.since;

-- name: beat_leader :one
-- The leading beat: the last one to take the lead, if its session still holds the
-- lock. pg_locks is readable by every role.
SELECT l.node, l.backend_pid, l.since
FROM {schema}.periodic_leader AS l
WHERE EXISTS (
    SELECT 1
    FROM pg_catalog.pg_locks AS k
    WHERE k.locktype = 'advisory'
      AND k.granted
      AND k.pid = l.backend_pid
      AND k.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())
      AND k.classid::bigint = {lock_beat}
      AND k.objid::bigint = (hashtext(%(schema)s::text)::bigint & 4294967295)
      AND k.objsubid = 2
);
