-- Generations in eras (issue 30). Migration 0012 drops an emptied generation with DETACH
-- and DROP, which take ACCESS EXCLUSIVE on the table the generation is a partition of:
-- message_store. A pg_dump holds ACCESS SHARE on message_store for its whole run, so
-- while it ran no generation was dropped: the emptied ones piled up (33 after eight
-- minutes of a dump, benchmarks/HISTORY.md), every statement set them up, and once
-- there were max_generations the current one grew for the rest of the dump.
--
-- Now a new generation is a partition of an era: a partition of message_store that is
-- itself partitioned by gen, over a range of ERA_GENERATIONS generation numbers. A
-- generation's drop locks its era only. A reader locks the tables there are when it
-- starts (pg_dump does), so once a reader keeps the current era from dropping its
-- generations, the era is closed and the next generation starts a new one, which that
-- reader has not locked: under a dump of hours the generations keep being dropped as
-- they empty, and only the reader's own era waits for it. An era that holds no
-- generation any more is dropped when message_store can be locked for a moment (the
-- reader ended). The generations attached to message_store itself before this
-- migration are dropped as before.

CREATE TABLE {schema}.era (
    -- the era holds the generations from base up to, not including, bound
    base bigint PRIMARY KEY,
    bound bigint NOT NULL,
    -- no new generation starts in it (a reader kept it from dropping generations)
    closed boolean NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT now(),
    -- the session whose lock kept the era from being dropped, as generation.blocked_by
    blocked_by integer,
    blocked_since timestamptz
);

-- A generation's partition; its era's, or message_store for one from before this
-- migration. NULL when it does not exist.
CREATE FUNCTION {schema}.generation_parent(g bigint)
RETURNS regclass
LANGUAGE sql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT i.inhparent::regclass
    FROM pg_catalog.pg_inherits AS i
    WHERE i.inhrelid = to_regclass(format('%I.%I', {schema}.schema_name(), 'message_store_' || g))
$$;

-- As migration 0012's, into the era that holds new_gen, which it starts if there is
-- none. An era is created on its own and then attached, as a generation is (0012 says
-- why); attaching it creates its partitioned indexes and clones the triggers.
CREATE OR REPLACE FUNCTION {schema}.add_generation(new_gen bigint)
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    nsp text := {schema}.schema_name();
    part text := 'message_store_' || new_gen;
    era_name text;
    -- generation numbers an era spans: a new era starts when they run out, or when a
    -- reader closes it (the numbers it skips are never used)
    era_generations constant bigint := 1000;
BEGIN
    SELECT 'message_era_' || r.base INTO era_name
    FROM {schema}.era AS r
    WHERE new_gen >= r.base AND new_gen < r.bound;
    IF era_name IS NULL THEN
        era_name := 'message_era_' || new_gen;
        EXECUTE format(
            'CREATE TABLE %I.%I (LIKE %I.message_store INCLUDING DEFAULTS INCLUDING GENERATED)'
            ' PARTITION BY RANGE (gen)',
            nsp, era_name, nsp
        );
        EXECUTE format(
            'ALTER TABLE %I.message_store ATTACH PARTITION %I.%I FOR VALUES FROM (%s) TO (%s)',
            nsp, nsp, era_name, new_gen, new_gen + era_generations
        );
        INSERT INTO {schema}.era (base, bound) VALUES (new_gen, new_gen + era_generations);
    END IF;
    -- the storage settings of migration 0012's
    EXECUTE format(
        'CREATE TABLE %I.%I (LIKE %I.message_store INCLUDING DEFAULTS INCLUDING GENERATED)'
        ' WITH (fillfactor = 50, vacuum_truncate = false,'
        ' autovacuum_vacuum_threshold = 1000, autovacuum_vacuum_scale_factor = 0.01,'
        ' autovacuum_vacuum_cost_delay = 0)',
        nsp, part, nsp
    );
    EXECUTE format(
        'ALTER TABLE %I.%I ATTACH PARTITION %I.%I FOR VALUES FROM (%s) TO (%s)',
        nsp, era_name, nsp, part, new_gen, new_gen + 1
    );
    INSERT INTO {schema}.generation (gen, state) VALUES (new_gen, 'next');
END
$$;
REVOKE ALL ON FUNCTION {schema}.add_generation(bigint) FROM PUBLIC;

-- Migration 0012's rotation, in the same steps with the same arguments (a process of
-- the previous version calls it unchanged during a rolling deploy), with eras:
-- 'move': the next generation is the one attached ahead, which is not always the
--    current one's number plus one: the generation after the current one in a closed
--    era starts a new era (at the closed one's bound);
-- 'drain', 'empty': "the previous generation" is the one before the current one, not
--    its number minus one;
-- 'drop': the emptied generations of one era (or of message_store, from before eras)
--    a step. When a reader keeps their era locked, and began before the oldest of
--    them existed (or has kept it for 60 seconds, where this role may not see when it
--    began), the era is closed. When there is none to drop, the eras that hold no
--    generation and will get none are dropped, with message_store locked a moment.
--    Returns the generations and eras dropped: the caller takes the step again while
--    it dropped some.
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
DECLARE
    nsp text := {schema}.schema_name();
    cur bigint;
    prev bigint;
    nxt bigint;
    age double precision;
    g record;
    p record;
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
    prev := coalesce((SELECT max(x.gen) FROM {schema}.generation AS x WHERE x.gen < cur), cur - 1);

    IF step = 'move' THEN
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
                    format('%I.%I', nsp, 'message_store_' || cur)::regclass) >= dead_limit))
        THEN
            PERFORM setval(format('%I.generation_seq', nsp)::regclass, nxt, true);
            UPDATE {schema}.generation SET state = 'live', changed_at = now() WHERE gen = cur;
            prev := cur;
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

        -- forward: what would keep an old generation alive, once little is left in it
        -- (a backlog that waits for consumers is not copied from one generation to the
        -- next; the statistics' count of live rows is enough to tell the two apart)
        FOR g IN
            SELECT x.gen FROM {schema}.generation AS x
            WHERE x.state = 'live' AND x.gen < prev
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
        -- as migration 0012's
        FOR g IN
            SELECT x.gen FROM {schema}.generation AS x
            WHERE x.state = 'live' AND x.gen < prev
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
                emptied := 1;
            END IF;
            EXIT;  -- one lock per step
        END LOOP;
        SELECT coalesce(min(x.gen), cur) INTO n
        FROM {schema}.generation AS x
        WHERE x.state IN ('live', 'current', 'next');
        UPDATE {schema}.rotation SET oldest = n WHERE oldest <> n;

    ELSIF step = 'empty' THEN
        -- as migration 0012's
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
        -- the emptied generations of one parent (an era, or message_store)
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
                FOR n IN SELECT unnest(p.gens) LOOP
                    EXECUTE format(
                        'ALTER TABLE %s DETACH PARTITION %I.%I', p.parent, nsp, 'message_store_' || n
                    );
                    EXECUTE format('DROP TABLE %I.%I', nsp, 'message_store_' || n);
                    DELETE FROM {schema}.generation WHERE gen = n;
                    dropped := dropped + 1;
                END LOOP;
            EXCEPTION WHEN lock_not_available THEN
                holders := {schema}.lock_holders(p.parent, before);
                UPDATE {schema}.generation
                SET blocked_by = holders[1],
                    blocked_since = CASE WHEN holders[1] IS NOT DISTINCT FROM blocked_by
                                         THEN blocked_since ELSE now() END
                WHERE gen = ANY(p.gens);
                -- a reader that holds the era since before these generations existed
                -- holds it to its end (a pg_dump): no new generation starts there
                UPDATE {schema}.era AS r
                SET closed = true
                WHERE NOT r.closed
                  AND to_regclass(format('%I.%I', nsp, 'message_era_' || r.base)) = p.parent
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
            RETURN;  -- one lock per step
        END LOOP;
        -- eras that hold no generation and will get none (closed, or passed)
        IF EXISTS (
            SELECT 1 FROM {schema}.era AS r
            WHERE (r.closed OR r.bound <= cur)
              AND NOT EXISTS (
                  SELECT 1 FROM {schema}.generation AS x WHERE x.gen >= r.base AND x.gen < r.bound
              )
        ) THEN
            part := format('%I.message_store', nsp)::regclass;
            before := {schema}.lock_holders(part);
            IF NOT EXISTS (
                SELECT 1 FROM {schema}.era AS r
                WHERE (r.closed OR r.bound <= cur) AND r.blocked_by = ANY(before)
            ) THEN
                BEGIN
                    EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', part);
                    FOR p IN
                        SELECT r.base FROM {schema}.era AS r
                        WHERE (r.closed OR r.bound <= cur)
                          AND NOT EXISTS (
                              SELECT 1 FROM {schema}.generation AS x
                              WHERE x.gen >= r.base AND x.gen < r.bound
                          )
                    LOOP
                        EXECUTE format(
                            'ALTER TABLE %s DETACH PARTITION %I.%I', part, nsp, 'message_era_' || p.base
                        );
                        EXECUTE format('DROP TABLE %I.%I', nsp, 'message_era_' || p.base);
                        DELETE FROM {schema}.era WHERE base = p.base;
                        dropped := dropped + 1;
                    END LOOP;
                EXCEPTION WHEN lock_not_available THEN
                    holders := {schema}.lock_holders(part, before);
                    UPDATE {schema}.era AS r
                    SET blocked_by = holders[1],
                        blocked_since = CASE WHEN holders[1] IS NOT DISTINCT FROM r.blocked_by
                                             THEN r.blocked_since ELSE now() END
                    WHERE r.closed OR r.bound <= cur;
                END;
            END IF;
        END IF;

    ELSE
        RAISE EXCEPTION 'pgqueue: rotate has no step %', step;
    END IF;
END
$$;
REVOKE ALL ON FUNCTION {schema}.rotate(text, text, double precision, double precision, bigint, integer, integer) FROM PUBLIC;
