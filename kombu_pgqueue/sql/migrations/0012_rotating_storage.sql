-- Message storage that rotates (issue 30). A snapshot that some session holds (pg_dump,
-- a long analytics query, a standby with hot_standby_feedback) keeps VACUUM from
-- removing the rows acked since it was taken; in one table every claim then walks them,
-- and the file keeps its size afterwards. Here messages live in generations: partitions
-- of message_store by column gen. Publishes go to the current generation; the rotation
-- (function rotate, called now and then by consumers) starts a new one, moves forward
-- what would keep an old one alive, and empties an old one that holds nothing live by
-- TRUNCATE, which gives its space back whatever snapshot is held.
--
-- Expand, then contract: table message stays for the previous version's processes
-- during a rolling deploy (their publishes keep their ON CONFLICT on it, their consumers
-- claim from it). rotate moves what they publish into message_store, where this
-- version's consumers claim it. A later migration drops message.

-- The current generation is this sequence's last value; a publish reads it as the
-- column's default (pg_sequence_last_value: no table read per row, COPY included).
CREATE SEQUENCE {schema}.generation_seq AS bigint MINVALUE 0 START 1;

CREATE TABLE {schema}.message_store (
    id bigserial,
    queue text NOT NULL,
    -- AMQP order: higher first
    priority smallint NOT NULL DEFAULT 0,
    -- true while an ETA lies ahead (see message_store_due_idx)
    delayed boolean NOT NULL DEFAULT false,
    -- visible from this time on: the ETA while delayed, the lease end while leased
    next_iteration timestamptz NOT NULL DEFAULT now(),
    attempts integer NOT NULL DEFAULT 0,
    -- the current delivery's fencing token; ack and renew must present it
    lease bigint,
    expires_at timestamptz,
    dedup_key text,
    created_at timestamptz NOT NULL DEFAULT now(),
    body bytea NOT NULL,
    content_type text,
    content_encoding text,
    -- json, not jsonb: stored as sent, no parse on the hot path
    headers json NOT NULL,
    properties json NOT NULL,
    -- next_iteration while delayed, else NULL: a claim never changes it, so the claim's
    -- update stays HOT (migration 0004)
    due_at timestamptz GENERATED ALWAYS AS (CASE WHEN delayed THEN next_iteration END) STORED,
    -- the generation (partition) the message is in; set by the default below
    gen bigint NOT NULL,
    -- a unique index of a partitioned table must contain the partition key; ids are
    -- unique by their sequence alone
    PRIMARY KEY (id, gen)
) PARTITION BY RANGE (gen);

-- The claim walks this index in delivery order and stops after LIMIT rows.
CREATE INDEX message_store_ready_idx ON {schema}.message_store (queue, priority DESC, id)
    WHERE NOT delayed;
CREATE INDEX message_store_due_idx ON {schema}.message_store (due_at) WHERE delayed;
CREATE INDEX message_store_expires_idx ON {schema}.message_store (expires_at)
    WHERE expires_at IS NOT NULL;
-- Not unique (it cannot be, across partitions): the keys are held in table dedup
-- (migration 0011); this finds the waiting message that a replacing publish overwrites.
CREATE INDEX message_store_dedup_idx ON {schema}.message_store (queue, dedup_key)
    WHERE dedup_key IS NOT NULL;

-- The generations that exist, and what became of each: 'next' (attached ahead, so that
-- a publish never finds its generation missing), 'current' (publishes go here),
-- 'live' (older, may hold messages), 'drained' (holds none; claims skip it), 'emptied'
-- (truncated; dropped when the partitioned table can be locked for a moment).
-- blocked_by is the session whose lock keeps a drained generation's space (a pg_dump).
CREATE TABLE {schema}.generation (
    gen bigint PRIMARY KEY,
    state text NOT NULL CHECK (state IN ('next', 'current', 'live', 'drained', 'emptied')),
    created_at timestamptz NOT NULL DEFAULT now(),
    changed_at timestamptz NOT NULL DEFAULT now(),
    blocked_by integer,
    blocked_since timestamptz
);

-- One row: what claims read to skip generations that hold nothing live.
CREATE TABLE {schema}.rotation (
    single boolean PRIMARY KEY DEFAULT true CHECK (single),
    -- no message lives in a generation before this one
    oldest bigint NOT NULL,
    rotated_at timestamptz NOT NULL DEFAULT now()
);

-- This schema's name, for the statements the functions below build (format's %I):
-- found through a table's row type, so that no schema name is written in a literal.
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

-- The partitions are created by rotate, which runs as the schema's owner: consumers
-- need no right to create or alter tables. A partition is created on its own and then
-- attached: CREATE TABLE ... PARTITION OF would take an ACCESS EXCLUSIVE lock on
-- message_store, which queues behind any reader (pg_dump holds ACCESS SHARE on it for
-- its whole run) and makes every claim and publish queue behind it. ATTACH takes SHARE
-- UPDATE EXCLUSIVE, which readers, claims and publishes do not conflict with.
CREATE FUNCTION {schema}.add_generation(new_gen bigint)
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    nsp text := {schema}.schema_name();
    part text := 'message_store_' || new_gen;
BEGIN
    -- The storage settings of the message table (migrations 0003, 0004): never give
    -- the empty tail back (TRUNCATE does), vacuum early and unthrottled, room for HOT.
    EXECUTE format(
        'CREATE TABLE %I.%I (LIKE %I.message_store INCLUDING DEFAULTS INCLUDING GENERATED)'
        ' WITH (fillfactor = 50, vacuum_truncate = false,'
        ' autovacuum_vacuum_threshold = 1000, autovacuum_vacuum_scale_factor = 0.01,'
        ' autovacuum_vacuum_cost_delay = 0)',
        nsp, part, nsp
    );
    EXECUTE format(
        'ALTER TABLE %I.message_store ATTACH PARTITION %I.%I FOR VALUES FROM (%s) TO (%s)',
        nsp, nsp, part, new_gen, new_gen + 1
    );
    INSERT INTO {schema}.generation (gen, state) VALUES (new_gen, 'next');
END
$$;
REVOKE ALL ON FUNCTION {schema}.add_generation(bigint) FROM PUBLIC;

SELECT {schema}.add_generation(1);
SELECT {schema}.add_generation(2);
UPDATE {schema}.generation SET state = 'current' WHERE gen = 1;
INSERT INTO {schema}.rotation (oldest) VALUES (1);

-- gen's default, and ids that never meet the previous table's: message keeps its
-- identity for the previous version's publishes, and rotate moves those rows here with
-- their ids, so ours start 2^40 beyond the largest it has given.
DO $migration_0012$
DECLARE
    nsp text := {schema}.schema_name();
    given bigint;
BEGIN
    EXECUTE format(
        'ALTER TABLE %I.message_store ALTER COLUMN gen'
        ' SET DEFAULT pg_catalog.pg_sequence_last_value(%L::pg_catalog.regclass)',
        nsp, format('%I.generation_seq', nsp)
    );
    EXECUTE format(
        'SELECT last_value FROM %s',
        pg_catalog.pg_get_serial_sequence(format('%I.message', nsp), 'id')
    ) INTO given;
    PERFORM pg_catalog.setval(
        format('%I.message_store_id_seq', nsp)::regclass,
        greatest(given, (SELECT coalesce(max(id), 0) FROM {schema}.dead_letter))
            + (2::bigint ^ 40)::bigint
    );
    -- generation 1 is current (a last value "called", else pg_sequence_last_value is NULL)
    PERFORM pg_catalog.setval(format('%I.generation_seq', nsp)::regclass, 1, true);
END
$migration_0012$;

-- Dedup keys (migration 0011) across both tables while the previous one lasts: a key is
-- held while its message is in either.
CREATE OR REPLACE FUNCTION {schema}.dedup_claim()
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
        IF EXISTS (SELECT 1 FROM {schema}.message_store AS m WHERE m.id = holder)
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

CREATE OR REPLACE FUNCTION {schema}.dedup_release()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    DELETE FROM {schema}.dedup AS d
    WHERE d.queue = OLD.queue
      AND d.dedup_key = OLD.dedup_key
      AND d.id = OLD.id
      AND NOT EXISTS (SELECT 1 FROM {schema}.message_store AS m WHERE m.id = OLD.id)
      AND NOT EXISTS (SELECT 1 FROM {schema}.message AS m WHERE m.id = OLD.id);
    RETURN NULL;
END
$$;

-- On the partitioned table, so every generation has them (cloned at ATTACH).
CREATE TRIGGER dedup_claim
BEFORE INSERT ON {schema}.message_store
FOR EACH ROW
WHEN (NEW.dedup_key IS NOT NULL)
EXECUTE FUNCTION {schema}.dedup_claim();

CREATE TRIGGER dedup_release
AFTER DELETE ON {schema}.message_store
FOR EACH ROW
WHEN (OLD.dedup_key IS NOT NULL)
EXECUTE FUNCTION {schema}.dedup_release();

-- An atomic task's ack in its own transaction (migration 0008), on the new storage.
CREATE OR REPLACE FUNCTION {schema}.ack_delivery(message_id bigint, lease_id bigint)
RETURNS void
LANGUAGE plpgsql
VOLATILE
AS $$
BEGIN
    DELETE FROM {schema}.message_store
    WHERE id = message_id
      AND lease = lease_id
      -- the live generations only (see the top of queries.sql)
      AND gen BETWEEN (SELECT r.oldest FROM {schema}.rotation AS r)
                  AND (SELECT s.last_value FROM {schema}.generation_seq AS s);
    IF NOT FOUND THEN
        RAISE EXCEPTION 'pgqueue: the lease of message % was lost', message_id
            USING ERRCODE = 'no_data_found';
    END IF;
END
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

-- The rotation, in steps; a consumer takes them every few seconds (transport option
-- rotate_interval), each step a statement, so a transaction of its own, and each returns
-- at once when there is nothing to do. One caller at a time (an advisory lock per
-- schema; another caller's step returns). It runs as the schema's owner. Every lock it
-- asks for waits at most lock_timeout (20 ms), and a step that locks a table for more
-- than a row's change locks one table only and then ends: holding one lock while it
-- waits for another would let a claim that waits for the first hold the second, a
-- deadlock (seen in the chaos snapshot scenario when one transaction took them all).
-- The steps, %(step)s:
-- 'move': what the previous version's publishers put in table message comes here; a
--    new generation, when the current one is %(max_age)s old, or %(min_age)s old and
--    holding %(dead_limit)s dead rows (VACUUM cannot remove them: a snapshot is held),
--    and the one after it attached ahead; what waits, is delayed or was leased and
--    lapsed in a generation older than the previous one moves to the current one, once
--    little is left there, so it keeps no old generation alive;
-- 'drain': one generation before the previous one that holds nothing is drained:
--    claims skip it (rotation.oldest); returns 1 when it drained one;
-- 'empty': one drained generation is emptied by TRUNCATE, unless a session that held a
--    lock on it the last time still holds one (pg_dump: its space comes back when that
--    ends); returns 1 when it emptied one;
-- 'drop': the emptied generations are dropped, which needs ACCESS EXCLUSIVE on
--    message_store for a moment.
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
    -- generations emptied (step empty) or drained (step drain): the caller takes the
    -- step again while it is 1
    OUT emptied integer,
    OUT dropped integer
)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    nsp text := {schema}.schema_name();
    cur bigint;
    age double precision;
    g record;
    part regclass;
    n bigint;
    found_any boolean;
    before integer[];
    holders integer[];
BEGIN
    rotated := false;
    moved := 0;
    emptied := 0;
    dropped := 0;
    -- {lock_rotation} 'pgqR': the rotation of one schema
    IF NOT pg_try_advisory_xact_lock({lock_rotation}, hashtext(nsp)) THEN
        RETURN;
    END IF;
    PERFORM set_config('lock_timeout', '20ms', true);
    cur := pg_sequence_last_value(format('%I.generation_seq', nsp)::regclass);

    IF step = 'move' THEN
        -- the previous version's table
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
            -- consumers hear of what is ready, as from a publish
            SELECT pg_notify(channel, 'r:' || coalesce(q.token, ''))
            FROM (SELECT DISTINCT s.queue FROM stored AS s WHERE NOT s.delayed) AS s
            LEFT JOIN {schema}.queue AS q ON q.name = s.queue
        )
        SELECT (SELECT count(*) FROM stored), (SELECT count(*) FROM woken) INTO moved, n;

        -- a new generation
        SELECT extract(EPOCH FROM now() - r.rotated_at) INTO age FROM {schema}.rotation AS r;
        IF EXISTS (SELECT 1 FROM {schema}.generation WHERE gen = cur + 1)
           AND (SELECT count(*) FROM {schema}.generation) < max_generations
           AND (age >= max_age OR (age >= min_age AND pg_stat_get_dead_tuples(
                    format('%I.%I', nsp, 'message_store_' || cur)::regclass) >= dead_limit))
        THEN
            PERFORM nextval(format('%I.generation_seq', nsp)::regclass);
            UPDATE {schema}.generation SET state = 'live', changed_at = now() WHERE gen = cur;
            cur := cur + 1;
            UPDATE {schema}.generation SET state = 'current', changed_at = now() WHERE gen = cur;
            UPDATE {schema}.rotation SET rotated_at = now();
            rotated := true;
        END IF;
        IF NOT EXISTS (SELECT 1 FROM {schema}.generation WHERE gen = cur + 1) THEN
            BEGIN
                -- committed with this step; a publish may use it from the next rotation on
                PERFORM {schema}.add_generation(cur + 1);
            EXCEPTION WHEN lock_not_available THEN
                NULL;  -- a VACUUM of message_store, say: the next step tries again
            END;
        END IF;

        -- forward: what would keep an old generation alive, once little is left in it
        -- (a backlog that waits for consumers is not copied from one generation to the
        -- next; the statistics' count of live rows is enough to tell the two apart)
        FOR g IN
            SELECT x.gen FROM {schema}.generation AS x
            WHERE x.state = 'live' AND x.gen < cur - 1
              AND pg_stat_get_live_tuples(
                    format('%I.%I', nsp, 'message_store_' || x.gen)::regclass) <= batch
            ORDER BY x.gen
        LOOP
            WITH picked AS (
                SELECT m.id FROM {schema}.message_store AS m
                WHERE m.gen = g.gen
                  AND (m.lease IS NULL OR m.next_iteration <= now())
                LIMIT batch
                FOR UPDATE SKIP LOCKED
            )
            UPDATE {schema}.message_store AS m
            SET gen = cur
            FROM picked
            WHERE m.gen = g.gen
              AND m.id = picked.id;
            GET DIAGNOSTICS n = ROW_COUNT;
            moved := moved + n;
        END LOOP;

    ELSIF step = 'drain' THEN
        -- the first generation before the previous one that looks empty (no lock for
        -- the look); then, under SHARE, which waits for a transaction that inserted into
        -- it and has not ended, the look again. Not only from the oldest on: a long
        -- task's message keeps its generation live until its lease is renewed (which
        -- moves it forward), but the generations after it can go meanwhile.
        FOR g IN
            SELECT x.gen FROM {schema}.generation AS x
            WHERE x.state = 'live' AND x.gen < cur - 1
              AND pg_stat_get_live_tuples(
                    format('%I.%I', nsp, 'message_store_' || x.gen)::regclass) <= batch
            ORDER BY x.gen
        LOOP
            part := format('%I.%I', nsp, 'message_store_' || g.gen)::regclass;
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
                SET state = 'drained', changed_at = now()
                WHERE gen = g.gen;
                emptied := 1;  -- for this step: one drained (see OUT emptied)
            END IF;
            EXIT;  -- one lock per step
        END LOOP;
        -- claims skip every generation before the oldest that may hold something
        SELECT coalesce(min(x.gen), cur) INTO n
        FROM {schema}.generation AS x
        WHERE x.state IN ('live', 'current', 'next');
        UPDATE {schema}.rotation SET oldest = n WHERE oldest <> n;

    ELSIF step = 'empty' THEN
        FOR g IN
            SELECT x.gen, x.blocked_by FROM {schema}.generation AS x
            WHERE x.state = 'drained'
            ORDER BY x.gen
        LOOP
            part := format('%I.%I', nsp, 'message_store_' || g.gen)::regclass;
            before := {schema}.lock_holders(part);
            IF g.blocked_by = ANY(before) THEN
                CONTINUE;  -- the same session holds it still: do not queue behind it
            END IF;
            BEGIN
                EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', part);
                -- a message that slipped in after it drained goes forward first
                EXECUTE format(
                    'UPDATE %I.message_store SET gen = %s WHERE gen = %s', nsp, cur, g.gen
                );
                GET DIAGNOSTICS n = ROW_COUNT;
                moved := moved + n;
                EXECUTE format('TRUNCATE %s', part);
                UPDATE {schema}.generation
                SET state = 'emptied', changed_at = now(), blocked_by = NULL,
                    blocked_since = NULL
                WHERE gen = g.gen;
                emptied := 1;
            EXCEPTION WHEN lock_not_available THEN
                -- the session that held a lock before and after the wait is the one to
                -- wait for
                holders := {schema}.lock_holders(part, before);
                UPDATE {schema}.generation
                SET blocked_by = holders[1],
                    blocked_since = CASE WHEN holders[1] IS NOT DISTINCT FROM blocked_by
                                         THEN blocked_since ELSE now() END
                WHERE gen = g.gen;
            END;
            EXIT;  -- one lock per step
        END LOOP;

    ELSIF step = 'drop' THEN
        IF EXISTS (SELECT 1 FROM {schema}.generation WHERE state = 'emptied') THEN
            part := format('%I.message_store', nsp)::regclass;
            before := {schema}.lock_holders(part);
            IF NOT EXISTS (
                SELECT 1 FROM {schema}.generation AS x
                WHERE x.state = 'emptied' AND x.blocked_by = ANY(before)
            ) THEN
                BEGIN
                    EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', part);
                    FOR g IN
                        SELECT x.gen FROM {schema}.generation AS x WHERE x.state = 'emptied'
                    LOOP
                        EXECUTE format(
                            'ALTER TABLE %s DETACH PARTITION %I.%I',
                            part, nsp, 'message_store_' || g.gen
                        );
                        EXECUTE format('DROP TABLE %I.%I', nsp, 'message_store_' || g.gen);
                        DELETE FROM {schema}.generation WHERE gen = g.gen;
                        dropped := dropped + 1;
                    END LOOP;
                EXCEPTION WHEN lock_not_available THEN
                    holders := {schema}.lock_holders(part, before);
                    UPDATE {schema}.generation
                    SET blocked_by = holders[1],
                        blocked_since = CASE WHEN holders[1] IS NOT DISTINCT FROM blocked_by
                                             THEN blocked_since ELSE now() END
                    WHERE state = 'emptied';
                END;
            END IF;
        END IF;

    ELSE
        RAISE EXCEPTION 'pgqueue: rotate has no step %', step;
    END IF;
END
$$;
REVOKE ALL ON FUNCTION {schema}.rotate(text, text, double precision, double precision, bigint, integer, integer) FROM PUBLIC;

-- The roles granted message (those that publish or consume, docs/operations.md) get the
-- same on message_store, the sequences its defaults read, what claims and monitoring
-- read of the rotation, and the rotation itself: an upgrade needs no new grants.
DO $migration_0012_grants$
DECLARE
    nsp text := {schema}.schema_name();
    granted record;
BEGIN
    FOR granted IN
        SELECT
            CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE a.grantee::regrole::text END AS role,
            string_agg(DISTINCT a.privilege_type, ', ') AS privileges,
            bool_or(a.privilege_type = 'DELETE') AS consumes
        FROM pg_catalog.pg_class AS c
        CROSS JOIN LATERAL aclexplode(c.relacl) AS a
        WHERE c.oid = (
                SELECT t.typrelid FROM pg_catalog.pg_type AS t
                WHERE t.oid = pg_typeof(NULL::{schema}.message)
            )
          AND a.grantee <> c.relowner
        GROUP BY a.grantee
    LOOP
        EXECUTE format('GRANT %s ON TABLE %I.message_store TO %s', granted.privileges, nsp, granted.role);
        EXECUTE format(
            'GRANT USAGE, SELECT ON SEQUENCE %I.message_store_id_seq, %I.generation_seq TO %s',
            nsp, nsp, granted.role
        );
        EXECUTE format('GRANT SELECT ON TABLE %I.rotation, %I.generation TO %s', nsp, nsp, granted.role);
        IF granted.consumes THEN
            EXECUTE format(
                'GRANT EXECUTE ON FUNCTION %I.rotate(text, text, double precision,'
                ' double precision, bigint, integer, integer) TO %s',
                nsp, granted.role
            );
        END IF;
    END LOOP;
END
$migration_0012_grants$;
