-- Handoff (see the top of sql/queries.sql): a consumer that waits for a queue, and may
-- take a message from it without a claim, has a row here, written by its LISTEN session
-- (statement watch) and deleted when it stops waiting (unwatch). The session holds the
-- advisory lock ({lock_consumer} 'pgqC', hashtext(consumer)) for as long as it lives, so a
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
