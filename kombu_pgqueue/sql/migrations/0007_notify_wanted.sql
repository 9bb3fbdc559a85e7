-- Whether a publish to a queue should NOTIFY: only when a consumer waits for it (see the
-- top of sql/queries.sql). Called by the publishing statements once per queue they
-- filled. With gate false (a publish inside an application's transaction, which may
-- last long) always true, and no lock taken. Otherwise: take the queue's 'pgqP' lock
-- shared until commit (a consumer that starts waiting waits for it), and true if a
-- consumer holds the queue's 'pgqW' lock (then this session cannot take it, even for
-- the instant it takes to let go again), or if 'pgqP' is not to be had (a consumer is
-- arming). Code of the previous version does not call it.
CREATE FUNCTION {schema}.notify_wanted(channel text, queue text, gate boolean)
RETURNS boolean
LANGUAGE sql
VOLATILE
AS $$
    SELECT CASE
        WHEN NOT gate THEN true
        WHEN NOT pg_try_advisory_xact_lock_shared({lock_publishing}, hashtext(channel || ':' || queue))
            THEN true
        WHEN pg_try_advisory_lock({lock_waiting}, hashtext(channel || ':' || queue))
            THEN NOT pg_advisory_unlock({lock_waiting}, hashtext(channel || ':' || queue))
        ELSE true
    END
$$;
