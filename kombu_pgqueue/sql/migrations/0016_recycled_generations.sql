-- Generations recycled, never dropped (issue 42). Migration 0014 dropped an emptied
-- generation, and an era once it held none. pg_dump lists the tables first and locks
-- them after, so a dump that listed a table the rotation then dropped stopped with
-- "relation does not exist" (1 in 300 to 600 dumps under load), as does anything else
-- that lists tables and then locks them (pg_dump -t, vacuumdb, logical replication's
-- initial copy, pg_repack). And TRUNCATE is not MVCC-safe: a generation emptied while
-- a dump held a snapshot older than the acks that drained it, but had not locked it yet,
-- was dumped empty, without messages that were waiting when the dump began.
--
-- Now:
-- - A table of the broker is never dropped while the broker runs. An emptied generation
--   is detached from its era and kept, empty, as a spare (table spare); the next
--   generation takes a spare and attaches it with its own bounds, and only when there
--   is none is a table created. An era that holds no generation is detached and kept
--   the same way, for the next era. Detached tables are not partitions, so statements
--   on message_store never see them; their number is the most the storage ever needed
--   at once (a few, or a few more for each dump that ran while generations turned).
-- - A generation's table is named once, when it is created (message_store_<the number
--   of its first generation>); column generation.relname (era.relname) names the table
--   a generation (era) is in now. A rename would break a dump that listed the old name.
-- - A drained generation is emptied only once no session of the database holds a
--   snapshot older than the step that drained it (generation.drained_xid): such a
--   snapshot may still see its rows (acked, or moved forward, after it was taken), and
--   a dump must find them there. Its space comes back when that snapshot ends; claims
--   skip it meanwhile, as before.
-- - Each step of the rotation is a function of its own (rotate_move, rotate_drain,
--   rotate_empty, rotate_recycle); rotate(step, ...) keeps its signature and its grant
--   and runs them, one caller at a time. Step 'drop', which a process of the previous
--   version still sends, recycles. Step 'repair' puts the generation sequence back at
--   the current generation after a restore (pg_dump reads sequences outside its
--   snapshot).
--
-- A later migration that changes message_store's columns must change the spares too
-- (ALTER TABLE on message_store reaches its partitions only).

ALTER TABLE {schema}.generation ADD COLUMN relname text;
UPDATE {schema}.generation SET relname = 'message_store_' || gen;
ALTER TABLE {schema}.generation ALTER COLUMN relname SET NOT NULL;
-- the full id (txid_current) of the step that drained it: a snapshot taken before that
-- step ended may still see its rows
ALTER TABLE {schema}.generation ADD COLUMN drained_xid bigint;
UPDATE {schema}.generation SET drained_xid = txid_current() WHERE state IN ('drained', 'emptied');

ALTER TABLE {schema}.era ADD COLUMN relname text;
UPDATE {schema}.era SET relname = 'message_era_' || base;
ALTER TABLE {schema}.era ALTER COLUMN relname SET NOT NULL;

-- Tables of the storage that hold nothing and are attached nowhere, kept for reuse:
-- emptied generations ('generation') and eras that held no generation any more ('era').
CREATE TABLE {schema}.spare (
    relname text PRIMARY KEY,
    kind text NOT NULL CHECK (kind IN ('generation', 'era')),
    since timestamptz NOT NULL DEFAULT now()
);

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

-- A generation's parent: its era, or message_store for one from before migration 0014.
CREATE OR REPLACE FUNCTION {schema}.generation_parent(g bigint)
RETURNS regclass
LANGUAGE sql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT i.inhparent::regclass
    FROM pg_catalog.pg_inherits AS i
    WHERE i.inhrelid = {schema}.generation_table(g)
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
-- if one can be locked, else a new one (the storage settings of migration 0012's). An
-- era that spans it is started if there is none, from a spare era if one can be
-- locked. A table is created on its own and then attached (migration 0012 says why).
CREATE OR REPLACE FUNCTION {schema}.add_generation(new_gen bigint)
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

-- Record on generations gens, or on eras, the session that keeps them waiting: the
-- first of holders, since when it has (kept when it is the same session as before).
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
-- those from before eras) are detached, their tables kept as spares for the next
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
-- process of a previous version calls it unchanged.
CREATE OR REPLACE FUNCTION {schema}.rotate(
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
