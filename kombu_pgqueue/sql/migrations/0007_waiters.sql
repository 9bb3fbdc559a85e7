-- Who a publish should wake (see the top of sql/queries.sql). A consumer that waits for
-- a queue has a row here, written by its LISTEN session, which holds the advisory lock
-- (1885827395 'pgqC', hashtext(consumer)) for as long as it lives. Unlogged: after a
-- crash the table is empty, and consumers, which reconnect, register again.
CREATE UNLOGGED TABLE {schema}.waiter (
    queue text NOT NULL,
    consumer text NOT NULL,
    PRIMARY KEY (queue, consumer)
);

-- notify_target(channel, queue, gate): NULL when nobody waits for the queue (no NOTIFY),
-- the id of one consumer that waits, chosen at random (a NOTIFY addressed to it: one
-- consumer claims, not all of them), or '' (a NOTIFY for every consumer of the queue).
-- Without gate (a publish inside an application's transaction, which may last long) ''
-- and no lock taken. Otherwise it first takes (1885827408 'pgqP', hashtext(channel ||
-- ':' || queue)) shared until commit: a consumer that starts waiting waits for it, then
-- claims; if that lock is not to be had, a consumer is arming right now: ''. A waiter
-- whose session is gone (its 'pgqC' lock is free) is removed on the way.
-- Code of the previous version does not call it.
CREATE FUNCTION {schema}.notify_target(channel text, queue text, gate boolean)
RETURNS text
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    picked text;
BEGIN
    IF NOT gate THEN
        RETURN '';
    END IF;
    IF NOT pg_try_advisory_xact_lock_shared(1885827408, hashtext(channel || ':' || queue)) THEN
        RETURN '';
    END IF;
    FOR attempt IN 1..3 LOOP
        SELECT w.consumer INTO picked
        FROM {schema}.waiter AS w
        WHERE w.queue = notify_target.queue
        ORDER BY random()
        LIMIT 1;
        IF picked IS NULL THEN
            RETURN NULL;
        END IF;
        IF NOT pg_try_advisory_xact_lock_shared(1885827395, hashtext(picked)) THEN
            RETURN picked;  -- its session holds the lock: alive
        END IF;
        DELETE FROM {schema}.waiter AS w
        WHERE w.queue = notify_target.queue AND w.consumer = picked;
    END LOOP;
    RETURN '';
END
$$;
