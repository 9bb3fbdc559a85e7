-- Periodic tasks kept in the broker's database (issue 44): celery_pgqueue's beat
-- scheduler, which every node may run. New tables only: code of the previous version
-- never reads them.
--
-- An entry's due times follow from its schedule and last_due, the latest due time
-- sent (or skipped). A beat sends due time T of an entry in the transaction that
-- moves last_due to T, under the condition last_due < T (statement fire_periodic):
-- a second beat, a restarted one or one that lost its leadership between deciding and
-- sending finds the row moved, and sends nothing. The schedule's own JSON is written
-- and read by celery_pgqueue (Celery's crontab, interval and solar schedules): this
-- package never interprets it.
CREATE TABLE {schema}.periodic_entry (
    name text PRIMARY KEY,
    task text NOT NULL,
    schedule jsonb NOT NULL,
    args jsonb NOT NULL DEFAULT '[]',
    kwargs jsonb NOT NULL DEFAULT '{{}}',
    options jsonb NOT NULL DEFAULT '{{}}',
    -- due times missed while no beat ran for longer than the catch-up window: sent
    -- once (the latest of them, as Celery's own scheduler does) or skipped
    missed text NOT NULL DEFAULT 'once' CHECK (missed IN ('once', 'skip')),
    enabled boolean NOT NULL DEFAULT true,
    -- 'config': synced from Celery's beat_schedule at each beat's start (and removed
    -- when it is gone from there); 'runtime': added by the CLI or the admin API
    origin text NOT NULL DEFAULT 'runtime' CHECK (origin IN ('config', 'runtime')),
    -- bumped by every change: a beat that read an older revision sends nothing
    revision bigint NOT NULL DEFAULT 1,
    last_due timestamptz NOT NULL,
    last_run_at timestamptz,
    total_run_count bigint NOT NULL DEFAULT 0,
    -- due times sent later than the beat's late_after, and the lateness of the last send
    late_count bigint NOT NULL DEFAULT 0,
    last_lateness double precision,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- The beat that took the leadership last: written by the beat that acquired the
-- session advisory lock ({lock_beat}, hashtext(schema)); it leads for as long as the
-- session of backend_pid holds that lock (pg_locks says so; statement beat_leader).
CREATE TABLE {schema}.periodic_leader (
    one boolean PRIMARY KEY DEFAULT true CHECK (one),
    node text NOT NULL,
    backend_pid integer NOT NULL,
    since timestamptz NOT NULL
);

-- The roles granted message_store (those that publish or consume, docs/operations.md)
-- get the same on the schedule's tables: a beat runs as a worker's role, and an upgrade
-- needs no new grants.
DO $migration_0017_grants$
DECLARE
    nsp text := {schema}.schema_name();
    granted record;
BEGIN
    FOR granted IN
        SELECT
            CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE a.grantee::regrole::text END AS role,
            string_agg(DISTINCT a.privilege_type, ', ') AS privileges
        FROM pg_catalog.pg_class AS c
        CROSS JOIN LATERAL aclexplode(c.relacl) AS a
        WHERE c.oid = format('%I.message_store', nsp)::regclass
          AND a.grantee <> c.relowner
          AND a.privilege_type IN ('SELECT', 'INSERT', 'UPDATE', 'DELETE')
        GROUP BY a.grantee
    LOOP
        EXECUTE format(
            'GRANT %s ON TABLE %I.periodic_entry, %I.periodic_leader TO %s',
            granted.privileges, nsp, nsp, granted.role
        );
    END LOOP;
END
$migration_0017_grants$;
