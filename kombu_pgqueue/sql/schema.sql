-- The broker's schema as migrations 0001 to 0017 leave it: each table with what its
-- columns mean, then the functions by concern. Written to be read; the migrations
-- (sql/migrations/NNNN_slug.sql) stay the source of truth, and say how and why each
-- piece came to be as it is.
--
-- Install and upgrade with `python -m kombu_pgqueue migrate` (or the transport option
-- auto_migrate, the default), never with this file: migrate creates the schema, applies
-- the versions it lacks under an advisory lock, and records them in schema_migration.
-- This file is for readers and for tests/db/test_schema_file.py, which installs it into
-- one fresh schema and the migrations into another and compares what PostgreSQL's
-- catalog says of both (tables, columns, constraints, indexes, functions, triggers,
-- sequences, privileges, comments, the rows installed). Applied to an empty schema in
-- one transaction it gives the same schema, version rows included, so migrate would take
-- it as current; nothing runs it so.
--
-- A new migration changes this file in the same commit: the table or function it
-- changes is changed here in place, as it now is. The test names every line where the
-- two disagree.
--
-- Written as the migrations are, and composed as they are (kombu_pgqueue/_sql.py,
-- compose): {schema} is the broker's schema, as psycopg.sql.Identifier quotes it;
-- {lock_rotation} and the like are the first keys of the advisory locks (_sql.LOCKS); a
-- literal brace is written twice. No schema name is written inside a string literal:
-- statements that need one as a value read it from schema_name().
--
-- Privileges: a fresh schema grants nothing beyond its owner. The roles that publish or
-- consume are granted by an administrator (docs/operations.md, "Privileges"). EXECUTE on
-- the rotation's functions is revoked from PUBLIC: function rotate, run as the schema's
-- owner, is the one door to them. (Migrations 0010, 0012 and 0017 also grant the tables
-- they add to the roles already granted the tables beside them, so an upgrade needs no
-- new grants; in a fresh schema there are none.)

-- == Versions ===========================================================================

-- The versions applied, one row each; created by kombu_pgqueue/migrations.py, which
-- reads the highest to know what to apply. Only the owner writes it.
CREATE TABLE {schema}.schema_migration (
    version integer PRIMARY KEY,
    name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

INSERT INTO {schema}.schema_migration (version, name)
VALUES
    (1, 'initial'),
    (2, 'dead_letter_dedup_key'),
    (3, 'message_churn_storage'),
    (4, 'hot_claims'),
    (5, 'dead_letter_error'),
    (6, 'failed_tasks'),
    (7, 'notify_wanted'),
    (8, 'ack_delivery'),
    (9, 'handoff'),
    (10, 'sealed_handoff'),
    (11, 'dedup_claims'),
    (12, 'rotating_storage'),
    (13, 'generation_floor'),
    (14, 'generation_eras'),
    (15, 'dedup_release_per_statement'),
    (16, 'recycled_generations'),
    (17, 'periodic_schedule');

-- == Queues, exchanges, bindings ========================================================

-- Declared queues. A queue needs no row to receive messages; the row carries the
-- RabbitMQ-style arguments (x-expires, x-message-ttl, x-max-priority).
CREATE TABLE {schema}.queue (
    name text PRIMARY KEY,
    expires interval,
    message_ttl interval,
    max_priority smallint,
    declared_at timestamptz NOT NULL DEFAULT now(),
    -- refreshed by consumers while they consume; x-expires counts from here
    used_at timestamptz NOT NULL DEFAULT now(),
    -- the queue's name in wakeups ('r:<token>'): 16 hex digits from the server's strong
    -- random source, new for each row, so only roles that may read this table can tell
    -- which queue a wakeup is about (docs/operations.md)
    token text COLLATE "C" NOT NULL DEFAULT left(md5(gen_random_uuid()::text), 16)
);

-- Exchanges and bindings are shared, so a message published in one process is
-- routed by bindings declared in another (Celery's remote control replies need it).
CREATE TABLE {schema}.exchange (
    name text PRIMARY KEY,
    type text NOT NULL CHECK (type IN ('direct', 'topic', 'fanout')),
    declared_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE {schema}.binding (
    exchange text NOT NULL,
    routing_key text NOT NULL,
    queue text NOT NULL,
    -- anchored regular expression for topic exchanges, NULL otherwise
    pattern text,
    PRIMARY KEY (exchange, routing_key, queue)
);

CREATE INDEX binding_queue_idx ON {schema}.binding (queue);

-- == Messages ===========================================================================

-- Messages live in generations: partitions of message_store by column gen. A snapshot
-- that some session holds (pg_dump, a long query, a standby with hot_standby_feedback)
-- keeps VACUUM from removing the rows acked since it was taken; in one table every
-- claim would walk them. Publishes go to the current generation; the rotation (function
-- rotate, below) starts new ones, moves forward what would keep an old one alive, and
-- empties an old one that holds nothing by TRUNCATE, which gives its space back
-- whatever snapshot is held.
--
-- A generation is a partition of an era, a partition of message_store that is itself
-- partitioned by gen over a range of generation numbers: a reader (pg_dump) locks the
-- tables there are when it starts, so once it keeps the current era's generations from
-- being recycled, the next generation starts a new era, which it has not locked. The
-- first two generations, installed below, are partitions of message_store itself.

-- The current generation is this sequence's last value; a publish reads it as gen's
-- default (pg_sequence_last_value: no table read per row, COPY included).
CREATE SEQUENCE {schema}.generation_seq AS bigint MINVALUE 0 START 1;

CREATE TABLE {schema}.message_store (
    -- unique by its sequence alone
    id bigserial,
    queue text NOT NULL,
    -- AMQP order: higher first
    priority smallint NOT NULL DEFAULT 0,
    -- true while an ETA lies ahead (see message_store_due_idx)
    delayed boolean NOT NULL DEFAULT false,
    -- visible from this time on: the ETA while delayed, the lease end while leased
    next_iteration timestamptz NOT NULL DEFAULT now(),
    -- deliveries so far; a claim buries a message that had max_attempts
    attempts integer NOT NULL DEFAULT 0,
    -- the current delivery's fencing token; ack and renew must present it
    lease bigint,
    -- its TTL ends (its expiration property, or the queue's x-message-ttl, whichever
    -- comes first); statement sweep drops it then
    expires_at timestamptz,
    -- held in table dedup while the message waits or runs
    dedup_key text,
    created_at timestamptz NOT NULL DEFAULT now(),
    body bytea NOT NULL,
    content_type text,
    content_encoding text,
    -- json, not jsonb: stored as sent, no parse on the hot path
    headers json NOT NULL,
    properties json NOT NULL,
    -- next_iteration while delayed, else NULL: a claim never changes it, so the claim's
    -- update, which moves next_iteration, changes no indexed column and stays HOT
    due_at timestamptz GENERATED ALWAYS AS (CASE WHEN delayed THEN next_iteration END) STORED,
    -- the generation (partition) the message is in. Its default, set below with the
    -- first generations, is the current one: generation_seq's last value.
    gen bigint NOT NULL,
    -- a unique index of a partitioned table must contain the partition key
    PRIMARY KEY (id, gen)
) PARTITION BY RANGE (gen);

-- The claim walks this index in delivery order and stops after LIMIT rows.
CREATE INDEX message_store_ready_idx ON {schema}.message_store (queue, priority DESC, id)
    WHERE NOT delayed;
-- The poll promotes due delayed messages from here.
CREATE INDEX message_store_due_idx ON {schema}.message_store (due_at) WHERE delayed;
CREATE INDEX message_store_expires_idx ON {schema}.message_store (expires_at)
    WHERE expires_at IS NOT NULL;
-- Not unique (it cannot be, across partitions): the keys are held in table dedup; this
-- finds the waiting message that a replacing publish overwrites.
CREATE INDEX message_store_dedup_idx ON {schema}.message_store (queue, dedup_key)
    WHERE dedup_key IS NOT NULL;

-- The generations that exist, and what became of each: 'next' (attached ahead, so that
-- a publish never finds its generation missing), 'current' (publishes go here),
-- 'live' (older, may hold messages), 'drained' (holds none; statements skip it),
-- 'emptied' (truncated; its table is detached and kept as a spare by the next step).
CREATE TABLE {schema}.generation (
    gen bigint PRIMARY KEY,
    state text NOT NULL CHECK (state IN ('next', 'current', 'live', 'drained', 'emptied')),
    created_at timestamptz NOT NULL DEFAULT now(),
    changed_at timestamptz NOT NULL DEFAULT now(),
    -- the session that keeps the rotation from the generation's next step (a lock it
    -- holds, or a snapshot older than the drain), and since when
    blocked_by integer,
    blocked_since timestamptz,
    -- the table that holds it now (message_store_<the first generation it held>); a
    -- table is named once, when it is created, never renamed: a dump that listed the
    -- old name would fail
    relname text NOT NULL,
    -- the full id (txid_current) of the step that drained it: a snapshot taken before
    -- that step ended may still see its rows, so it is emptied only once none is held
    drained_xid bigint
);

-- The eras: partitions of message_store that hold generations from base up to, not
-- including, bound.
CREATE TABLE {schema}.era (
    base bigint PRIMARY KEY,
    bound bigint NOT NULL,
    -- no new generation starts in it (a reader kept it from recycling generations)
    closed boolean NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT now(),
    -- the session whose lock kept the era from being detached, as generation.blocked_by
    blocked_by integer,
    blocked_since timestamptz,
    -- the table that holds it now, as generation.relname
    relname text NOT NULL
);

-- Tables of the storage that hold nothing and are attached nowhere, kept for reuse:
-- emptied generations ('generation') and eras that held no generation any more ('era').
-- A table of the broker is never dropped while the broker runs: pg_dump (and vacuumdb,
-- logical replication's initial copy, pg_repack) lists the tables first and locks them
-- after, and would stop at one dropped in between.
CREATE TABLE {schema}.spare (
    relname text PRIMARY KEY,
    kind text NOT NULL CHECK (kind IN ('generation', 'era')),
    since timestamptz NOT NULL DEFAULT now()
);

-- One row: what statements read to skip generations that hold nothing live.
CREATE TABLE {schema}.rotation (
    single boolean PRIMARY KEY DEFAULT true CHECK (single),
    -- no message lives in a generation before this one (the floor, sql/queries.sql)
    oldest bigint NOT NULL,
    rotated_at timestamptz NOT NULL DEFAULT now()
);

-- This schema's name, for the statements that functions build (format's %I): found
-- through a table's row type, so that no schema name is written in a literal.
CREATE FUNCTION {schema}.schema_name()
RETURNS text
LANGUAGE sql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT n.nspname FROM pg_catalog.pg_class AS c
    JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
    WHERE c.oid = (SELECT t.typrelid FROM pg_catalog.pg_type AS t
                   WHERE t.oid = pg_typeof(NULL::{schema}.message_store))
$$;

-- gen's default: the current generation. Composed here, since the sequence's name is a
-- value (a regclass constant) in it, and no schema name is written inside a literal.
DO $schema_file$
BEGIN
    EXECUTE format(
        'ALTER TABLE %I.message_store ALTER COLUMN gen'
        ' SET DEFAULT pg_catalog.pg_sequence_last_value(%L::pg_catalog.regclass)',
        {schema}.schema_name(), format('%I.generation_seq', {schema}.schema_name())
    );
END
$schema_file$;

-- The first two generations: 1 current, 2 attached ahead. Partitions of message_store
-- itself, not of an era (they predate eras); the rotation recycles them as any other.
-- Created with PARTITION OF, unlike later ones (add_generation says why): nothing reads
-- message_store yet.
-- The storage settings of every generation, for a table that is inserted into, updated
-- once (the claim) and deleted from (the ack), over and over:
-- * fillfactor 50: each message is written twice (the insert, then the claim's
--   version), so pages are filled to half by inserts and the claim's version lands
--   beside the original, a HOT update that no index sees;
-- * VACUUM never truncates the empty tail (TRUNCATE gives the space back), whose ACCESS
--   EXCLUSIVE lock would stall every claim and ack while it scans back over the tail;
-- * autovacuum starts after 1 % of the rows (plus 1,000) are dead instead of 20 %, and
--   is not throttled: dead rows at the head are what every claim from the head steps
--   over until VACUUM removes them.
CREATE TABLE {schema}.message_store_1 PARTITION OF {schema}.message_store
    FOR VALUES FROM (1) TO (2)
    WITH (fillfactor = 50, vacuum_truncate = false, autovacuum_vacuum_threshold = 1000,
          autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_cost_delay = 0);

CREATE TABLE {schema}.message_store_2 PARTITION OF {schema}.message_store
    FOR VALUES FROM (2) TO (3)
    WITH (fillfactor = 50, vacuum_truncate = false, autovacuum_vacuum_threshold = 1000,
          autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_cost_delay = 0);

INSERT INTO {schema}.generation (gen, state, relname)
VALUES (1, 'current', 'message_store_1'), (2, 'next', 'message_store_2');

INSERT INTO {schema}.rotation (oldest) VALUES (1);

-- generation 1 is current (a last value "called": else pg_sequence_last_value is NULL)
SELECT pg_catalog.setval(format('%I.generation_seq', {schema}.schema_name())::regclass, 1, true);

-- ids start 2^40 beyond the previous version's table's (message, below), so that the
-- rows the rotation moves here from it keep theirs
SELECT pg_catalog.setval(
    format('%I.message_store_id_seq', {schema}.schema_name())::regclass, 1099511627777, true
);

-- == Dedup keys =========================================================================

-- Which message holds each dedup key. A unique index of a partitioned table must
-- contain its partition key, so no index of message_store can keep a key unique across
-- generations: a key is claimed here by a trigger on every insert, whichever statement
-- inserts (publish, publish_many, COPY's publish_staged, Spark, a requeued dead letter).
-- A message whose key another waiting or running message holds is skipped.
CREATE TABLE {schema}.dedup (
    queue text NOT NULL,
    dedup_key text NOT NULL,
    -- the message that holds the key; the key is free again once that message is gone
    id bigint NOT NULL,
    PRIMARY KEY (queue, dedup_key)
);

-- The triggers' functions run as the schema's owner, so that a role that may publish
-- needs no grant on dedup. Names are schema-qualified; search_path is pinned so that no
-- role can slip a table of its own in front of them.
--
-- A key taken: by this very message (it moves between generations or tables), by a
-- message that still waits or runs in a live generation or in the previous version's
-- table (skip this one), or by one that is gone (take it over); the row lock orders two
-- publishers that would both take it.
CREATE FUNCTION {schema}.dedup_claim()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    holder bigint;
BEGIN
    LOOP
        INSERT INTO {schema}.dedup (queue, dedup_key, id)
        VALUES (NEW.queue, NEW.dedup_key, NEW.id)
        ON CONFLICT (queue, dedup_key) DO NOTHING;
        IF FOUND THEN
            RETURN NEW;
        END IF;
        SELECT d.id INTO holder
        FROM {schema}.dedup AS d
        WHERE d.queue = NEW.queue
          AND d.dedup_key = NEW.dedup_key
        FOR UPDATE;
        IF NOT FOUND THEN
            CONTINUE;
        END IF;
        IF holder = NEW.id THEN
            RETURN NEW;  -- the same message, moving between generations or tables
        END IF;
        IF EXISTS (SELECT 1 FROM {schema}.message_store AS m
                   WHERE m.id = holder
                     AND m.gen >= (SELECT r.oldest FROM {schema}.rotation AS r))
           OR EXISTS (SELECT 1 FROM {schema}.message AS m WHERE m.id = holder) THEN
            RETURN NULL;
        END IF;
        UPDATE {schema}.dedup AS d
        SET id = NEW.id
        WHERE d.queue = NEW.queue
          AND d.dedup_key = NEW.dedup_key;
        RETURN NEW;
    END LOOP;
END
$$;

-- The keys of every message a DELETE statement removed (an ack, a reject, an expiry, a
-- purge), from its transition table, once per statement. A move between generations is
-- an UPDATE, so the messages it moves keep their keys without a look.
CREATE FUNCTION {schema}.dedup_release_deleted()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- a statement that deleted no message with a key (a claim's empty dead-letter
    -- branch, a Kombu message's ack) neither plans the DELETE nor locks dedup
    IF EXISTS (SELECT 1 FROM gone AS m WHERE m.dedup_key IS NOT NULL) THEN
        DELETE FROM {schema}.dedup AS d
        USING gone AS m
        WHERE m.dedup_key IS NOT NULL
          AND d.queue = m.queue
          AND d.dedup_key = m.dedup_key
          AND d.id = m.id;
    END IF;
    RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION {schema}.dedup_release_deleted() FROM PUBLIC;

-- WHEN is evaluated without calling the function: a message without a key costs
-- nothing more. On the partitioned table, so every generation has it (cloned to each
-- partition).
CREATE TRIGGER dedup_claim
BEFORE INSERT ON {schema}.message_store
FOR EACH ROW
WHEN (NEW.dedup_key IS NOT NULL)
EXECUTE FUNCTION {schema}.dedup_claim();

-- Replacing this trigger takes message_store's ACCESS EXCLUSIVE lock (docs/operations.md
-- on migration 0015, which did so).
CREATE TRIGGER dedup_release
AFTER DELETE ON {schema}.message_store
REFERENCING OLD TABLE AS gone
FOR EACH STATEMENT
EXECUTE FUNCTION {schema}.dedup_release_deleted();

-- == Dead letters =======================================================================

-- Messages rejected without requeue ('rejected'), delivered max_attempts times
-- ('max_attempts'), whose consumer's callback raised ('consumer_error') or whose body
-- could not be decoded ('undecodable'), and tasks that failed for good, kept by
-- celery_pgqueue's keep_failed ('failed'). Nothing leaves the broker without an ack, a
-- TTL that ran out, or a row here.
CREATE TABLE {schema}.dead_letter (
    id bigint PRIMARY KEY,
    queue text NOT NULL,
    priority smallint NOT NULL,
    attempts integer NOT NULL,
    reason text NOT NULL,
    created_at timestamptz NOT NULL,
    died_at timestamptz NOT NULL DEFAULT now(),
    body bytea NOT NULL,
    content_type text,
    content_encoding text,
    headers json NOT NULL,
    properties json NOT NULL,
    -- kept, so that a requeued dead letter blocks duplicates again
    dedup_key text,
    -- why it died, beyond its reason: the exception a consumer's callback raised on it
    -- (consumer_error), the error decoding its body (undecodable), or "Type: message" of
    -- a failed task (failed); NULL for rejects and for messages over max_attempts
    error text,
    -- a failed task's traceback (reason failed); NULL for every other reason
    traceback text
);

CREATE INDEX dead_letter_queue_idx ON {schema}.dead_letter (queue, died_at);
-- `dead list --reason failed` and `dead purge --older-than 7d` read by reason and by age
CREATE INDEX dead_letter_reason_idx ON {schema}.dead_letter (reason, died_at);
CREATE INDEX dead_letter_died_idx ON {schema}.dead_letter (died_at);

-- A claim's dead letters: the candidates that already had their max_attempts, from the
-- live generations into dead_letter. The claim (sql/queries.sql) calls it only when
-- there are some, so that a claim that buries nothing runs no DELETE, and trigger
-- dedup_release does not run for every claim. As the claim's role.
CREATE FUNCTION {schema}.bury_exhausted(ids bigint[], oldest bigint)
RETURNS TABLE (id bigint, priority smallint, attempts integer, headers json)
LANGUAGE sql
VOLATILE
AS $$
    WITH exhausted AS (
        DELETE FROM {schema}.message_store AS m
        WHERE m.id = ANY(ids)
          AND m.gen >= oldest
        RETURNING m.id, m.queue, m.priority, m.attempts, m.created_at, m.dedup_key,
                  m.body, m.content_type, m.content_encoding, m.headers, m.properties
    )
    INSERT INTO {schema}.dead_letter AS d (
        id, queue, priority, attempts, reason, created_at, dedup_key,
        body, content_type, content_encoding, headers, properties
    )
    SELECT e.id, e.queue, e.priority, e.attempts, 'max_attempts', e.created_at, e.dedup_key,
           e.body, e.content_type, e.content_encoding, e.headers, e.properties
    FROM exhausted AS e
    RETURNING d.id, d.priority, d.attempts, d.headers
$$;

-- == Consumers, wakeups and handoffs ====================================================

-- Handoff (see the top of sql/queries.sql): a consumer that waits for a queue, and may
-- take a message from it without a claim, has a row here, written by its LISTEN session
-- (statement watch) and deleted when it stops waiting (unwatch). The session holds the
-- advisory lock ({lock_consumer} 'pgqC', hashtext(consumer)) for as long as it lives, so a
-- row whose lock is free is a consumer that is gone. Unlogged: after a crash the table
-- is empty, and consumers, whose sessions that crash ended, register again.
CREATE UNLOGGED TABLE {schema}.listener (
    queue text NOT NULL,
    -- 16 random hex digits, a new id per LISTEN session
    consumer text COLLATE "C" NOT NULL,
    -- the consumer's visibility_timeout: the lease a publish gives the message it hands
    -- to this consumer (whose lease keeper renews at a third of that)
    lease_seconds double precision NOT NULL,
    -- signs the handoffs to this consumer (see statement publish), so that a role that
    -- reads a handoff on the channel cannot address it to another consumer
    secret text NOT NULL,
    PRIMARY KEY (queue, consumer)
);

-- The schema's key: a handoff's message is sealed with it (AES-256-GCM, by the
-- publishing client) and opened by the consumer. PostgreSQL has no privilege on a LISTEN
-- channel, so any role that may connect reads every payload; only the broker's roles
-- may read this table.
CREATE TABLE {schema}.handoff_key (
    -- one row
    single boolean PRIMARY KEY DEFAULT true CHECK (single),
    -- 32 bytes (244 random bits from two gen_random_uuid)
    key bytea NOT NULL CHECK (length(key) = 32)
);

INSERT INTO {schema}.handoff_key (key)
VALUES (sha256(convert_to(gen_random_uuid()::text || gen_random_uuid()::text, 'UTF8')));

-- Whether a publish to a queue should NOTIFY: only when a consumer waits for it (see the
-- top of sql/queries.sql). Called by the publishing statements once per queue they
-- filled. With gate false (a publish inside an application's transaction, which may
-- last long) always true, and no lock taken. Otherwise: take the queue's 'pgqP' lock
-- shared until commit (a consumer that starts waiting waits for it), and true if a
-- consumer holds the queue's 'pgqW' lock (then this session cannot take it, even for
-- the instant it takes to let go again), or if 'pgqP' is not to be had (a consumer is
-- arming).
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

-- == Acks in a task's own transaction ===================================================

-- An atomic task's ack inside the task's transaction (statement ack_in_transaction):
-- true when the delivery's lease still held its row. The live generations only: the
-- floor is read into a variable first, which PL/pgSQL passes to the statement as a
-- parameter, so the planner skips the drained generations before it starts.
CREATE FUNCTION {schema}.delete_delivery(message_id bigint, lease_id bigint)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    floor bigint := (SELECT r.oldest FROM {schema}.rotation AS r);
BEGIN
    DELETE FROM {schema}.message_store
    WHERE id = message_id
      AND lease = lease_id
      AND gen >= floor;
    RETURN FOUND;
END
$$;

-- The same for kombu_pgqueue.atomic.Fence.settle, which sends "SELECT ack_delivery(id,
-- lease); COMMIT" as one simple query: one round trip for the ack and the commit. A
-- delete that finds no row (the lease was lost) raises no_data_found, which aborts the
-- transaction, so the COMMIT behind it ends it as a rollback.
CREATE FUNCTION {schema}.ack_delivery(message_id bigint, lease_id bigint)
RETURNS void
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    floor bigint := (SELECT r.oldest FROM {schema}.rotation AS r);
BEGIN
    DELETE FROM {schema}.message_store
    WHERE id = message_id
      AND lease = lease_id
      AND gen >= floor;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'pgqueue: the lease of message % was lost', message_id
            USING ERRCODE = 'no_data_found';
    END IF;
END
$$;

-- == Periodic tasks =====================================================================

-- Periodic tasks kept in the broker's database: celery_pgqueue's beat scheduler, which
-- every node may run. An entry's due times follow from its schedule and last_due, the
-- latest due time sent (or skipped). A beat sends due time T of an entry in the
-- transaction that moves last_due to T, under the condition last_due < T (statement
-- fire_periodic): a second beat, a restarted one or one that lost its leadership
-- between deciding and sending finds the row moved, and sends nothing. The schedule's
-- own JSON is written and read by celery_pgqueue (Celery's crontab, interval and solar
-- schedules): this package never interprets it.
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

-- == The rotation =======================================================================

-- Consumers take its steps every few seconds (transport option rotate_interval; the
-- Rotator's thread, Store.rotate), each step a statement, so a transaction of its own:
-- 'move' (rotate_move), 'drain' (rotate_drain), 'empty' (rotate_empty), 'recycle'
-- (rotate_recycle), and 'repair' (rotate_repair) before a process's first statement.
-- Each returns at once when there is nothing to do. They run through function rotate,
-- at the end, as the schema's owner: consumers need no right to create or alter tables.

-- The generation publishes go to, and the one before it (not always its number minus
-- one: a closed era's successor starts at that era's bound).
CREATE FUNCTION {schema}.current_generation()
RETURNS bigint
LANGUAGE sql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT pg_sequence_last_value(format('%I.generation_seq', {schema}.schema_name())::regclass)
$$;

CREATE FUNCTION {schema}.previous_generation(cur bigint)
RETURNS bigint
LANGUAGE sql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT coalesce(max(x.gen), cur - 1) FROM {schema}.generation AS x WHERE x.gen < cur
$$;

-- The table that holds generation g now; NULL when there is none.
CREATE FUNCTION {schema}.generation_table(g bigint)
RETURNS regclass
LANGUAGE sql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT to_regclass(format('%I.%I', {schema}.schema_name(), x.relname))
    FROM {schema}.generation AS x
    WHERE x.gen = g
$$;

-- A generation's parent: its era, or message_store for the first generations.
CREATE FUNCTION {schema}.generation_parent(g bigint)
RETURNS regclass
LANGUAGE sql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT i.inhparent::regclass
    FROM pg_catalog.pg_inherits AS i
    WHERE i.inhrelid = {schema}.generation_table(g)
$$;

-- The live generations before prev with at most batch rows left (by the statistics): a
-- backlog that waits for consumers is not copied from one generation to the next, and
-- the statistics' count of live rows is enough to tell the two apart.
CREATE FUNCTION {schema}.nearly_drained(prev bigint, batch integer)
RETURNS SETOF bigint
LANGUAGE sql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT x.gen FROM {schema}.generation AS x
    WHERE x.state = 'live' AND x.gen < prev
      AND pg_stat_get_live_tuples({schema}.generation_table(x.gen)) <= batch
    ORDER BY x.gen
$$;

-- The sessions other than this one that hold a lock on table rel now, of those in
-- among if given: the rotation asks before it waits, and after its wait failed, and
-- the session that held a lock both times is the one it waits for (a pg_dump).
CREATE FUNCTION {schema}.lock_holders(rel regclass, among integer[] DEFAULT NULL)
RETURNS integer[]
LANGUAGE sql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT array_agg(DISTINCT l.pid)
    FROM pg_catalog.pg_locks AS l
    WHERE l.locktype = 'relation'
      AND l.relation = rel
      AND l.granted
      AND l.pid <> pg_backend_pid()
      AND (among IS NULL OR l.pid = ANY(among))
$$;

-- The sessions of this database, other than this one, that hold a snapshot taken
-- before transaction since (a full id, as txid_current gives) had ended. backend_xmin
-- is a 32-bit id that every role may read; it is widened here against the next id.
CREATE FUNCTION {schema}.snapshots_before(since bigint)
RETURNS integer[]
LANGUAGE sql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    WITH horizon AS (
        SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS next_xid
    )
    SELECT array_agg(a.pid ORDER BY a.pid)
    FROM pg_catalog.pg_stat_activity AS a
    CROSS JOIN horizon AS h
    WHERE a.datname = current_database()
      AND a.pid <> pg_backend_pid()
      AND a.backend_xmin IS NOT NULL
      AND h.next_xid
          - ((h.next_xid % 4294967296 - a.backend_xmin::text::bigint + 4294967296) % 4294967296)
          < since
$$;

-- Record on generations gens the session that keeps them waiting: the first of
-- holders, since when it has (kept when it is the same session as before).
CREATE FUNCTION {schema}.note_blocked(gens bigint[], holders integer[])
RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    UPDATE {schema}.generation
    SET blocked_by = holders[1],
        blocked_since = CASE WHEN holders[1] IS NOT DISTINCT FROM blocked_by
                             THEN blocked_since ELSE now() END
    WHERE gen = ANY(gens)
$$;
REVOKE ALL ON FUNCTION {schema}.note_blocked(bigint[], integer[]) FROM PUBLIC;

-- A spare table of kind, locked for this transaction, taken off the list; NULL when
-- there is none that can be locked at once (another session, a dump that listed it,
-- holds it: the next one is tried).
CREATE FUNCTION {schema}.take_spare(wanted text)
RETURNS text
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    nsp text := {schema}.schema_name();
    s record;
BEGIN
    FOR s IN
        SELECT x.relname FROM {schema}.spare AS x WHERE x.kind = wanted ORDER BY x.since
    LOOP
        BEGIN
            EXECUTE format('LOCK TABLE %I.%I IN ACCESS EXCLUSIVE MODE', nsp, s.relname);
            DELETE FROM {schema}.spare WHERE relname = s.relname;
            RETURN s.relname;
        EXCEPTION WHEN lock_not_available THEN
            NULL;
        END;
    END LOOP;
    RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION {schema}.take_spare(text) FROM PUBLIC;

-- Generation new_gen, attached ahead ('next'), in the era that spans it: a spare table
-- if one can be locked, else a new one, with the storage settings of the first
-- generations (above). An era that spans it is started if there is none, from a spare
-- era if one can be locked. A table is created on its own and then attached: CREATE
-- TABLE ... PARTITION OF would take an ACCESS EXCLUSIVE lock on the parent, which
-- queues behind any reader (pg_dump holds ACCESS SHARE on it for its whole run) and
-- makes every claim and publish queue behind it; ATTACH takes SHARE UPDATE EXCLUSIVE,
-- which readers, claims and publishes do not conflict with.
CREATE FUNCTION {schema}.add_generation(new_gen bigint)
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    nsp text := {schema}.schema_name();
    part text;
    era_name text;
    -- generation numbers an era spans: a new era starts when they run out, or when a
    -- reader closes it (the numbers it skips are never used)
    era_generations constant bigint := 1000;
BEGIN
    SELECT r.relname INTO era_name
    FROM {schema}.era AS r
    WHERE new_gen >= r.base AND new_gen < r.bound;
    IF era_name IS NULL THEN
        era_name := {schema}.take_spare('era');
        IF era_name IS NULL THEN
            era_name := 'message_era_' || new_gen;
            EXECUTE format(
                'CREATE TABLE %I.%I (LIKE %I.message_store INCLUDING DEFAULTS INCLUDING GENERATED)'
                ' PARTITION BY RANGE (gen)',
                nsp, era_name, nsp
            );
        END IF;
        EXECUTE format(
            'ALTER TABLE %I.message_store ATTACH PARTITION %I.%I FOR VALUES FROM (%s) TO (%s)',
            nsp, nsp, era_name, new_gen, new_gen + era_generations
        );
        INSERT INTO {schema}.era (base, bound, relname)
        VALUES (new_gen, new_gen + era_generations, era_name);
    END IF;
    part := {schema}.take_spare('generation');
    IF part IS NULL THEN
        part := 'message_store_' || new_gen;
        EXECUTE format(
            'CREATE TABLE %I.%I (LIKE %I.message_store INCLUDING DEFAULTS INCLUDING GENERATED)'
            ' WITH (fillfactor = 50, vacuum_truncate = false,'
            ' autovacuum_vacuum_threshold = 1000, autovacuum_vacuum_scale_factor = 0.01,'
            ' autovacuum_vacuum_cost_delay = 0)',
            nsp, part, nsp
        );
    END IF;
    EXECUTE format(
        'ALTER TABLE %I.%I ATTACH PARTITION %I.%I FOR VALUES FROM (%s) TO (%s)',
        nsp, era_name, nsp, part, new_gen, new_gen + 1
    );
    INSERT INTO {schema}.generation (gen, state, relname) VALUES (new_gen, 'next', part);
END
$$;
REVOKE ALL ON FUNCTION {schema}.add_generation(bigint) FROM PUBLIC;

-- Step 'repair': the generation sequence back at the current generation, when a restore
-- left it ahead. pg_dump reads a sequence's value as it dumps it, not as its snapshot
-- saw it: a dump taken while generations turned holds table generation as they were
-- when it began and generation_seq as it was later, maybe at a generation the dump
-- does not hold, into which every publish (gen's default is the sequence's value)
-- would fail. Each process runs it before its first statement (_pool.get_pool), and
-- step 'move' first; it does nothing when they agree. 1 when it moved the sequence.
CREATE FUNCTION {schema}.rotate_repair()
RETURNS integer
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cur bigint := (SELECT max(x.gen) FROM {schema}.generation AS x WHERE x.state = 'current');
BEGIN
    IF cur IS NULL OR cur = {schema}.current_generation() THEN
        RETURN 0;
    END IF;
    PERFORM setval(format('%I.generation_seq', {schema}.schema_name())::regclass, cur, true);
    RETURN 1;
END
$$;
REVOKE ALL ON FUNCTION {schema}.rotate_repair() FROM PUBLIC;

-- Step 'move': the previous version's messages into message_store; a new generation
-- when the current one is old enough (max_age), or has dead_limit dead rows and is
-- min_age old, with one attached ahead; and forward what would keep an old generation
-- alive, once little is left in it.
CREATE FUNCTION {schema}.rotate_move(
    channel text,
    max_age double precision,
    min_age double precision,
    dead_limit bigint,
    batch integer,
    max_generations integer,
    OUT rotated boolean,
    OUT moved bigint
)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    nsp text := {schema}.schema_name();
    cur bigint;
    nxt bigint;
    age double precision;
    g bigint;
    n bigint;
BEGIN
    rotated := false;
    moved := 0;
    PERFORM {schema}.rotate_repair();
    cur := {schema}.current_generation();
    -- the previous version's table, until a later migration drops it
    IF to_regclass(format('%I.message', nsp)) IS NOT NULL THEN
        WITH taken AS (
            DELETE FROM {schema}.message AS m
            WHERE m.id IN (
                SELECT o.id FROM {schema}.message AS o
                WHERE o.lease IS NULL OR o.next_iteration <= now()
                ORDER BY o.id
                LIMIT batch
                FOR UPDATE SKIP LOCKED
            )
            RETURNING m.*
        ),
        stored AS (
            INSERT INTO {schema}.message_store (
                id, queue, priority, delayed, next_iteration, attempts, lease, expires_at,
                dedup_key, created_at, body, content_type, content_encoding, headers,
                properties, gen
            )
            SELECT id, queue, priority, delayed, next_iteration, attempts, lease, expires_at,
                   dedup_key, created_at, body, content_type, content_encoding, headers,
                   properties, cur
            FROM taken
            RETURNING queue, delayed
        ),
        woken AS (
            SELECT pg_notify(channel, 'r:' || coalesce(q.token, ''))
            FROM (SELECT DISTINCT s.queue FROM stored AS s WHERE NOT s.delayed) AS s
            LEFT JOIN {schema}.queue AS q ON q.name = s.queue
        )
        SELECT (SELECT count(*) FROM stored), (SELECT count(*) FROM woken) INTO moved, n;
    END IF;

    -- a new generation: the one attached ahead
    nxt := (SELECT min(x.gen) FROM {schema}.generation AS x WHERE x.state = 'next');
    SELECT extract(EPOCH FROM now() - r.rotated_at) INTO age FROM {schema}.rotation AS r;
    IF nxt IS NOT NULL
       AND (SELECT count(*) FROM {schema}.generation) < max_generations
       AND (age >= max_age OR (age >= min_age AND pg_stat_get_dead_tuples(
                {schema}.generation_table(cur)) >= dead_limit))
    THEN
        PERFORM setval(format('%I.generation_seq', nsp)::regclass, nxt, true);
        UPDATE {schema}.generation SET state = 'live', changed_at = now() WHERE gen = cur;
        cur := nxt;
        UPDATE {schema}.generation SET state = 'current', changed_at = now() WHERE gen = cur;
        UPDATE {schema}.rotation SET rotated_at = now();
        rotated := true;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM {schema}.generation WHERE state = 'next') THEN
        -- after the current one, or, when its era is closed, at the start of the next
        nxt := coalesce(
            (SELECT r.bound FROM {schema}.era AS r
             WHERE r.closed AND cur >= r.base AND cur < r.bound),
            cur + 1
        );
        BEGIN
            -- committed with this step; a publish may use it from the next rotation on
            PERFORM {schema}.add_generation(nxt);
        EXCEPTION WHEN lock_not_available THEN
            NULL;  -- a VACUUM of message_store, say: the next step tries again
        END;
    END IF;

    FOR g IN SELECT * FROM {schema}.nearly_drained({schema}.previous_generation(cur), batch)
    LOOP
        WITH picked AS (
            SELECT m.id FROM {schema}.message_store AS m
            WHERE m.gen = g
              AND (m.lease IS NULL OR m.next_iteration <= now())
            LIMIT batch
            FOR UPDATE SKIP LOCKED
        )
        UPDATE {schema}.message_store AS m
        SET gen = cur
        FROM picked
        WHERE m.gen = g
          AND m.id = picked.id;
        GET DIAGNOSTICS n = ROW_COUNT;
        moved := moved + n;
    END LOOP;
END
$$;
REVOKE ALL ON FUNCTION {schema}.rotate_move(text, double precision, double precision, bigint, integer, integer) FROM PUBLIC;

-- Step 'drain': the oldest nearly drained generation that holds no row, looked at under
-- a SHARE lock (no write to it can be under way), is marked drained, with the id of
-- this step's transaction; statements skip it from then on (rotation.oldest). One lock
-- a step: 1 when it drained one.
CREATE FUNCTION {schema}.rotate_drain(batch integer)
RETURNS integer
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cur bigint := {schema}.current_generation();
    g bigint;
    part regclass;
    found_any boolean;
    drained integer := 0;
    n bigint;
BEGIN
    FOR g IN SELECT * FROM {schema}.nearly_drained({schema}.previous_generation(cur), batch)
    LOOP
        part := {schema}.generation_table(g);
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s)', part) INTO found_any;
        CONTINUE WHEN found_any;
        BEGIN
            EXECUTE format('LOCK TABLE %s IN SHARE MODE', part);
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s)', part) INTO found_any;
        EXCEPTION WHEN lock_not_available THEN
            found_any := true;
        END;
        IF NOT found_any THEN
            UPDATE {schema}.generation
            SET state = 'drained', changed_at = now(), drained_xid = txid_current()
            WHERE gen = g;
            drained := 1;
        END IF;
        EXIT;
    END LOOP;
    SELECT coalesce(min(x.gen), cur) INTO n
    FROM {schema}.generation AS x
    WHERE x.state IN ('live', 'current', 'next');
    UPDATE {schema}.rotation SET oldest = n WHERE oldest <> n;
    RETURN drained;
END
$$;
REVOKE ALL ON FUNCTION {schema}.rotate_drain(integer) FROM PUBLIC;

-- Step 'empty': the oldest drained generation that no snapshot can still see rows of,
-- and no session holds a lock on, is emptied with TRUNCATE (what is left in it goes to
-- the current generation first). One lock a step: 1 when it emptied one.
CREATE FUNCTION {schema}.rotate_empty(OUT emptied integer, OUT moved bigint)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    nsp text := {schema}.schema_name();
    cur bigint := {schema}.current_generation();
    g record;
    part regclass;
    before integer[];
    holders integer[];
BEGIN
    emptied := 0;
    moved := 0;
    FOR g IN
        SELECT x.gen, x.blocked_by, x.drained_xid FROM {schema}.generation AS x
        WHERE x.state = 'drained'
        ORDER BY x.gen
    LOOP
        -- TRUNCATE is not MVCC-safe: a snapshot from before the drain would find the
        -- table empty, a dump without messages that were waiting when it began
        holders := {schema}.snapshots_before(g.drained_xid);
        IF holders IS NOT NULL THEN
            PERFORM {schema}.note_blocked(ARRAY[g.gen], holders);
            CONTINUE;
        END IF;
        part := {schema}.generation_table(g.gen);
        before := {schema}.lock_holders(part);
        IF g.blocked_by = ANY(before) THEN
            CONTINUE;  -- the same session holds it still: do not queue behind it
        END IF;
        BEGIN
            EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', part);
            EXECUTE format(
                'UPDATE %I.message_store SET gen = %s WHERE gen = %s', nsp, cur, g.gen
            );
            GET DIAGNOSTICS moved = ROW_COUNT;
            EXECUTE format('TRUNCATE %s', part);
            UPDATE {schema}.generation
            SET state = 'emptied', changed_at = now(), blocked_by = NULL, blocked_since = NULL
            WHERE gen = g.gen;
            emptied := 1;
        EXCEPTION WHEN lock_not_available THEN
            PERFORM {schema}.note_blocked(ARRAY[g.gen], {schema}.lock_holders(part, before));
        END;
        EXIT;
    END LOOP;
END
$$;
REVOKE ALL ON FUNCTION {schema}.rotate_empty() FROM PUBLIC;

-- Step 'recycle': the emptied generations of one parent (an era, or message_store for
-- the first generations) are detached, their tables kept as spares for the next
-- generations. When a reader keeps their era locked, and began before the oldest of
-- them existed (or has kept it for 60 seconds, where this role may not see when it
-- began), the era is closed: the next generation starts a new era, which that reader
-- has not locked. When there is none to recycle, the eras that hold no generation and
-- will get none are detached from message_store (locked a moment) and kept as spares.
-- Returns the generations and eras recycled: the caller takes the step again while it
-- recycled some.
CREATE FUNCTION {schema}.rotate_recycle()
RETURNS integer
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    nsp text := {schema}.schema_name();
    cur bigint := {schema}.current_generation();
    store regclass := format('%I.message_store', nsp)::regclass;
    p record;
    r record;
    g bigint;
    before integer[];
    holders integer[];
    recycled integer := 0;
BEGIN
    FOR p IN
        SELECT {schema}.generation_parent(x.gen) AS parent,
               array_agg(x.gen) AS gens,
               min(x.created_at) AS oldest_created,
               array_agg(x.blocked_by) FILTER (WHERE x.blocked_by IS NOT NULL) AS blockers
        FROM {schema}.generation AS x
        WHERE x.state = 'emptied'
          AND {schema}.generation_parent(x.gen) IS NOT NULL
        GROUP BY 1
        ORDER BY min(x.gen)
    LOOP
        before := {schema}.lock_holders(p.parent);
        IF p.blockers && before THEN
            CONTINUE;  -- a session that kept them before holds its lock still
        END IF;
        BEGIN
            EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', p.parent);
            FOR g IN SELECT unnest(p.gens) LOOP
                EXECUTE format(
                    'ALTER TABLE %s DETACH PARTITION %s', p.parent, {schema}.generation_table(g)
                );
                INSERT INTO {schema}.spare (relname, kind)
                SELECT x.relname, 'generation' FROM {schema}.generation AS x WHERE x.gen = g;
                DELETE FROM {schema}.generation WHERE gen = g;
                recycled := recycled + 1;
            END LOOP;
        EXCEPTION WHEN lock_not_available THEN
            holders := {schema}.lock_holders(p.parent, before);
            PERFORM {schema}.note_blocked(p.gens, holders);
            -- a reader that holds the era since before these generations existed
            -- holds it to its end (a pg_dump): no new generation starts there
            UPDATE {schema}.era AS e
            SET closed = true
            WHERE NOT e.closed
              AND to_regclass(format('%I.%I', nsp, e.relname)) = p.parent
              AND EXISTS (
                  SELECT 1 FROM pg_catalog.pg_stat_activity AS a
                  WHERE a.pid = ANY(holders)
                    AND (a.xact_start < p.oldest_created
                         OR EXISTS (
                             SELECT 1 FROM {schema}.generation AS x
                             WHERE x.gen = ANY(p.gens)
                               AND x.blocked_by = a.pid
                               AND x.blocked_since <= now() - interval '60 seconds'
                         ))
              );
        END;
        RETURN recycled;  -- one lock a step
    END LOOP;

    -- eras that hold no generation and will get none (closed, or passed)
    IF NOT EXISTS (
        SELECT 1 FROM {schema}.era AS e
        WHERE (e.closed OR e.bound <= cur)
          AND NOT EXISTS (
              SELECT 1 FROM {schema}.generation AS x WHERE x.gen >= e.base AND x.gen < e.bound
          )
    ) THEN
        RETURN recycled;
    END IF;
    before := {schema}.lock_holders(store);
    IF EXISTS (
        SELECT 1 FROM {schema}.era AS e
        WHERE (e.closed OR e.bound <= cur) AND e.blocked_by = ANY(before)
    ) THEN
        RETURN recycled;
    END IF;
    BEGIN
        EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', store);
        FOR r IN
            SELECT e.base, e.relname FROM {schema}.era AS e
            WHERE (e.closed OR e.bound <= cur)
              AND NOT EXISTS (
                  SELECT 1 FROM {schema}.generation AS x
                  WHERE x.gen >= e.base AND x.gen < e.bound
              )
        LOOP
            EXECUTE format('ALTER TABLE %s DETACH PARTITION %I.%I', store, nsp, r.relname);
            INSERT INTO {schema}.spare (relname, kind) VALUES (r.relname, 'era');
            DELETE FROM {schema}.era WHERE base = r.base;
            recycled := recycled + 1;
        END LOOP;
    EXCEPTION WHEN lock_not_available THEN
        holders := {schema}.lock_holders(store, before);
        UPDATE {schema}.era AS e
        SET blocked_by = holders[1],
            blocked_since = CASE WHEN holders[1] IS NOT DISTINCT FROM e.blocked_by
                                 THEN e.blocked_since ELSE now() END
        WHERE e.closed OR e.bound <= cur;
    END;
    RETURN recycled;
END
$$;
REVOKE ALL ON FUNCTION {schema}.rotate_recycle() FROM PUBLIC;

-- One step of the rotation, as the schema's owner, by one caller at a time (an advisory
-- lock per schema; a step returns at once when another is taking one), every lock it
-- asks for waited on 20 ms at most, so that claims and publishes never queue behind a
-- rotation that queues behind a reader. The arguments are migration 0012's, so that a
-- process of a previous version calls it unchanged; step 'drop' is what such a process
-- sends for 'recycle'. The one function of the rotation that a consumer's role may
-- execute (docs/operations.md).
CREATE FUNCTION {schema}.rotate(
    step text,
    channel text,
    max_age double precision,
    min_age double precision,
    dead_limit bigint,
    batch integer,
    max_generations integer,
    OUT rotated boolean,
    OUT moved bigint,
    OUT emptied integer,
    OUT dropped integer
)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    rotated := false;
    moved := 0;
    emptied := 0;
    dropped := 0;
    -- {lock_rotation} 'pgqR': the rotation of one schema
    IF NOT pg_try_advisory_xact_lock({lock_rotation}, hashtext({schema}.schema_name())) THEN
        RETURN;
    END IF;
    PERFORM set_config('lock_timeout', '20ms', true);
    CASE step
        WHEN 'move' THEN
            SELECT s.rotated, s.moved INTO rotated, moved
            FROM {schema}.rotate_move(channel, max_age, min_age, dead_limit, batch,
                                      max_generations) AS s;
        WHEN 'drain' THEN
            emptied := {schema}.rotate_drain(batch);
        WHEN 'empty' THEN
            SELECT s.emptied, s.moved INTO emptied, moved FROM {schema}.rotate_empty() AS s;
        WHEN 'recycle', 'drop' THEN
            -- 'drop': a process of the previous version
            dropped := {schema}.rotate_recycle();
        WHEN 'repair' THEN
            dropped := {schema}.rotate_repair();
        ELSE
            RAISE EXCEPTION 'pgqueue: rotate has no step %', step;
    END CASE;
END
$$;
REVOKE ALL ON FUNCTION {schema}.rotate(text, text, double precision, double precision, bigint, integer, integer) FROM PUBLIC;

-- == The previous version's tables ======================================================

-- Kept for a rolling upgrade (expand, then contract) until a later migration drops
-- them: processes of the version before rotating storage still publish into message
-- and claim from it (step 'move' brings what they publish into message_store), and
-- register their consumers in waiter, to which they hand messages unsealed.
CREATE TABLE {schema}.message (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue text NOT NULL,
    priority smallint NOT NULL DEFAULT 0,
    delayed boolean NOT NULL DEFAULT false,
    next_iteration timestamptz NOT NULL DEFAULT now(),
    attempts integer NOT NULL DEFAULT 0,
    lease bigint,
    expires_at timestamptz,
    dedup_key text,
    created_at timestamptz NOT NULL DEFAULT now(),
    body bytea NOT NULL,
    content_type text,
    content_encoding text,
    headers json NOT NULL,
    properties json NOT NULL,
    due_at timestamptz GENERATED ALWAYS AS (CASE WHEN delayed THEN next_iteration END) STORED
) WITH (fillfactor = 50, vacuum_truncate = false, autovacuum_vacuum_threshold = 1000,
        autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_cost_delay = 0);

CREATE INDEX message_ready_idx ON {schema}.message (queue, priority DESC, id)
    WHERE NOT delayed;
CREATE INDEX message_expires_idx ON {schema}.message (expires_at)
    WHERE expires_at IS NOT NULL;
-- that version's publishes skip a taken key by ON CONFLICT on it
CREATE UNIQUE INDEX message_dedup_idx ON {schema}.message (queue, dedup_key)
    WHERE dedup_key IS NOT NULL;
CREATE INDEX message_due_idx ON {schema}.message (due_at) WHERE delayed;

-- A message that leaves table message frees its key, unless the same message still
-- exists (in a live generation, moved there by step 'move'), row by row.
CREATE FUNCTION {schema}.dedup_release()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    floor bigint := (SELECT r.oldest FROM {schema}.rotation AS r);
BEGIN
    DELETE FROM {schema}.dedup AS d
    WHERE d.queue = OLD.queue
      AND d.dedup_key = OLD.dedup_key
      AND d.id = OLD.id
      AND NOT EXISTS (SELECT 1 FROM {schema}.message_store AS m
                      WHERE m.id = OLD.id AND m.gen >= floor)
      AND NOT EXISTS (SELECT 1 FROM {schema}.message AS m WHERE m.id = OLD.id);
    RETURN NULL;
END
$$;

-- Its inserts claim keys through the same trigger as message_store's, so both versions
-- agree on which key is taken during a rolling deploy.
CREATE TRIGGER dedup_claim
BEFORE INSERT ON {schema}.message
FOR EACH ROW
WHEN (NEW.dedup_key IS NOT NULL)
EXECUTE FUNCTION {schema}.dedup_claim();

CREATE TRIGGER dedup_release
AFTER DELETE ON {schema}.message
FOR EACH ROW
WHEN (OLD.dedup_key IS NOT NULL)
EXECUTE FUNCTION {schema}.dedup_release();

-- As listener, for consumers of that version.
CREATE UNLOGGED TABLE {schema}.waiter (
    queue text NOT NULL,
    consumer text COLLATE "C" NOT NULL,
    lease_seconds double precision NOT NULL,
    secret text NOT NULL,
    PRIMARY KEY (queue, consumer)
);
