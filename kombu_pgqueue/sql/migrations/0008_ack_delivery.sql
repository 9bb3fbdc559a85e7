-- The ack of an atomic task's delivery inside the task's own transaction (statement
-- ack_in_transaction, as a function): kombu_pgqueue.atomic.Fence.settle sends
-- "SELECT ack_delivery(id, lease); COMMIT" as one simple query, one round trip for the
-- ack and the commit, whose parse is trivial and whose plan the session keeps. A delete
-- that finds no row (the lease was lost: another delivery holds the message, or it is
-- gone) raises no_data_found, which aborts the transaction, so the COMMIT behind it
-- ends it as a rollback. Code of the previous version does not call it.
CREATE FUNCTION {schema}.ack_delivery(message_id bigint, lease_id bigint)
RETURNS void
LANGUAGE plpgsql
VOLATILE
AS $$
BEGIN
    DELETE FROM {schema}.message
    WHERE id = message_id
      AND lease = lease_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'pgqueue: the lease of message % was lost', message_id
            USING ERRCODE = 'no_data_found';
    END IF;
END
$$;
