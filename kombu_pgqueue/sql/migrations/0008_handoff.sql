-- Handoff (see the top of sql/queries.sql): a consumer that waits for a queue, and may
-- take a message from it without a claim, has a row here, written by its LISTEN session
-- (statement watch) and deleted when it stops waiting (unwatch). The session holds the
-- advisory lock (1885827395 'pgqC', hashtext(consumer)) for as long as it lives, so a
-- row whose lock is free is a consumer that is gone. Unlogged: after a crash the table
-- is empty, and consumers, whose sessions that crash ended, register again.
CREATE UNLOGGED TABLE {schema}.waiter (
    queue text NOT NULL,
    -- 16 random hex digits, a new id per LISTEN session
    consumer text COLLATE "C" NOT NULL,
    -- the consumer's visibility_timeout: the lease a publish gives the message it hands
    -- to this consumer (whose lease keeper renews at a third of that)
    lease_seconds double precision NOT NULL,
    -- signs the handoffs to this consumer (see statement publish): a role that may only
    -- connect, LISTEN and NOTIFY cannot read it, so it cannot forge one
    secret text NOT NULL,
    PRIMARY KEY (queue, consumer)
);

-- Whom a publish to a queue hands its message to: NULL when nobody waits for the queue
-- (no NOTIFY: notify_wanted), the id of one live waiting consumer (the publish leases
-- the message to it and the NOTIFY carries the message), or '' when a consumer waits
-- but none was found in this table (an older worker, a consumer arming, a gone one
-- picked): a NOTIFY for every consumer of the queue, which claim. The pick starts at a
-- random id: two probes of the primary key, whatever the number of waiters, and no
-- pg_locks scan; the liveness test is one advisory lock try. Code of the previous
-- version does not call it.
CREATE FUNCTION {schema}.handoff_target(channel text, queue text)
RETURNS text
LANGUAGE sql
VOLATILE
AS $$
    SELECT CASE
        WHEN NOT {schema}.notify_wanted(channel, queue, true) THEN NULL
        ELSE coalesce((
            SELECT picked.consumer
            FROM (
                (
                    SELECT w.consumer
                    FROM {schema}.waiter AS w
                    WHERE w.queue = handoff_target.queue
                      AND w.consumer >= left(md5(random()::text), 16)
                    ORDER BY w.consumer
                    LIMIT 1
                )
                UNION ALL
                (
                    SELECT w.consumer
                    FROM {schema}.waiter AS w
                    WHERE w.queue = handoff_target.queue
                    ORDER BY w.consumer
                    LIMIT 1
                )
                LIMIT 1
            ) AS picked
            -- its LISTEN session holds the lock exclusively while it lives
            WHERE NOT pg_try_advisory_xact_lock_shared(1885827395, hashtext(picked.consumer))
        ), '')
    END
$$;
