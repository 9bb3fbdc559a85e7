-- Statements for monitors (kombu_pgqueue._monitor, celery_pgqueue.metrics). A scrape
-- runs them, so each one costs a bounded amount whatever the table holds: index
-- probes and LIMIT-ed index scans, never a count over the whole message table.
-- %(schema)s is the schema's name as data, for the catalog views.

-- name: queue_depths :many
-- Per queue: ready, leased, delayed and dead messages, whether each count is exact,
-- and the age of the oldest ready message. A count is exact up to %(cap)s messages
-- (per queue; for delayed messages, in all queues together); above that it is an
-- estimate from the statistics ANALYZE keeps (pg_stats) and the live-row count the
-- server keeps for every table (pg_stat_user_tables).
WITH RECURSIVE pair AS (
    -- Loose index scan of message_ready_idx: one probe per (queue, priority) that has
    -- messages which are not delayed, however many messages there are.
    (
        SELECT queue, priority
        FROM {schema}.message_store
        WHERE NOT delayed
        ORDER BY queue, priority DESC
        LIMIT 1
    )
    UNION ALL
    SELECT following.queue, following.priority
    FROM pair
    CROSS JOIN LATERAL (
        (
            SELECT m.queue, m.priority
            FROM {schema}.message_store AS m
            WHERE NOT m.delayed
              AND m.queue = pair.queue
              AND m.priority < pair.priority
            ORDER BY m.priority DESC
            LIMIT 1
        )
        UNION ALL
        (
            SELECT m.queue, m.priority
            FROM {schema}.message_store AS m
            WHERE NOT m.delayed
              AND m.queue > pair.queue
            ORDER BY m.queue, m.priority DESC
            LIMIT 1
        )
        LIMIT 1
    ) AS following
),
dead_queue AS (
    -- the same over dead_letter_queue_idx
    (
        SELECT queue
        FROM {schema}.dead_letter
        ORDER BY queue
        LIMIT 1
    )
    UNION ALL
    SELECT (
        SELECT d.queue
        FROM {schema}.dead_letter AS d
        WHERE d.queue > dead_queue.queue
        ORDER BY d.queue
        LIMIT 1
    )
    FROM dead_queue
    WHERE dead_queue.queue IS NOT NULL
),
delayed_sample AS MATERIALIZED (
    -- the soonest due delayed messages, at most %(cap)s + 1 of them: all of them
    -- when there are not more than %(cap)s
    SELECT queue
    FROM {schema}.message_store
    WHERE delayed
    ORDER BY due_at
    LIMIT %(cap)s::bigint + 1
),
delayed_seen AS (
    SELECT queue, count(*) AS seen
    FROM delayed_sample
    GROUP BY queue
),
generations AS (
    -- the partitions of message_store (migration 0012), the largest first
    SELECT t.relname, greatest(t.n_live_tup, 0)::float8 AS live
    FROM pg_catalog.pg_partition_tree(to_regclass(format('%%I.message_store', %(schema)s::text)))
        AS p
    JOIN pg_stat_user_tables AS t ON t.relid = p.relid
    -- the generations themselves, not the eras they are in (migration 0014)
    WHERE p.isleaf
),
live_rows AS (
    -- kept current by every commit, unlike pg_class.reltuples; 'message' stands for
    -- all generations together
    SELECT 'message'::name AS relname, coalesce(sum(live), 0) AS live,
           (SELECT g.relname FROM generations AS g ORDER BY g.live DESC LIMIT 1) AS sampled
    FROM generations
    UNION ALL
    SELECT relname, greatest(n_live_tup, 0)::float8, relname
    FROM pg_stat_user_tables
    WHERE schemaname = %(schema)s
      AND relname = 'dead_letter'
),
queue_freq AS (
    -- per table, ANALYZE's most common queues and the share of each other queue
    SELECT
        r.relname AS tablename,
        s.most_common_vals::text::text[] AS vals,
        s.most_common_freqs AS freqs,
        (1 - s.null_frac - coalesce((SELECT sum(f) FROM unnest(s.most_common_freqs) AS f), 0))
            / greatest(
                CASE WHEN s.n_distinct < 0 THEN -s.n_distinct * r.live ELSE s.n_distinct END
                    - coalesce(cardinality(s.most_common_freqs), 0),
                1
            ) AS other_freq,
        r.live
    FROM live_rows AS r
    -- ANALYZE's figures of the largest generation stand for all of them
    JOIN pg_stats AS s ON s.tablename = r.sampled
    WHERE s.schemaname = %(schema)s
      AND s.attname = 'queue'
),
delayed_total AS MATERIALIZED (
    -- how many delayed messages there are: counted up to %(cap)s, estimated beyond
    SELECT
        (SELECT count(*) FROM delayed_sample) AS seen,
        (
            SELECT r.live * coalesce(
                s.most_common_freqs[array_position(s.most_common_vals::text::text[], 't')], 0
            )
            FROM live_rows AS r
            JOIN pg_stats AS s ON s.tablename = r.sampled
            WHERE s.schemaname = %(schema)s
              AND r.relname = 'message'
              AND s.attname = 'delayed'
        ) AS estimate
),
named AS (
    -- every queue there is something to say about, as one array (see counted)
    SELECT array_agg(DISTINCT found.queue) AS queues
    FROM (
        SELECT queue FROM pair
        UNION ALL
        SELECT queue FROM dead_queue WHERE queue IS NOT NULL
        UNION ALL
        SELECT queue FROM delayed_seen
        UNION ALL
        SELECT name FROM {schema}.queue
        UNION ALL
        -- when the delayed sample is cut short: big queues that hold only delayed
        -- messages beyond it
        SELECT unnest(vals)
        FROM queue_freq
        WHERE tablename = 'message'
          AND (SELECT seen FROM delayed_total) > %(cap)s
    ) AS found (queue)
),
head AS (
    -- For each (queue, priority): the first ready message at that priority or below,
    -- in delivery order, stepping over leased ones. Each priority's oldest ready
    -- message is among these, so their minimum is the queue's. (With priority = the
    -- planner would drop it from the sort order, walk message_pkey in id order and
    -- read every other queue's rows on the way.)
    SELECT pair.queue, pair.priority, next_ready.priority AS ready_priority,
           next_ready.id, next_ready.created_at
    FROM pair
    LEFT JOIN LATERAL (
        SELECT m.priority, m.id, m.created_at
        FROM {schema}.message_store AS m
        WHERE m.queue = pair.queue
          AND NOT m.delayed
          AND m.priority <= pair.priority
          AND (m.lease IS NULL OR m.next_iteration <= coalesce(%(now)s::timestamptz, now()))
        ORDER BY m.priority DESC, m.id
        LIMIT 1
    ) AS next_ready ON true
),
counted AS (
    SELECT
        named.queue,
        visible.seen AS visible_seen,
        visible.leased,
        coalesce(delayed_seen.seen, 0) AS delayed_seen,
        dead.seen AS dead_seen,
        front.oldest_ready,
        front.leased AS front_leased,
        coalesce(
            message_freq.freqs[array_position(message_freq.vals, named.queue)],
            message_freq.other_freq
        ) * message_freq.live AS message_estimate,
        -- only for the queues ANALYZE lists among the most common
        message_freq.freqs[array_position(message_freq.vals, named.queue)]
            * message_freq.live AS common_estimate,
        coalesce(
            dead_freq.freqs[array_position(dead_freq.vals, named.queue)],
            dead_freq.other_freq
        ) * dead_freq.live AS dead_estimate
    -- unnest of an array the planner cannot see into: it reckons with 10 queues, not
    -- the thousand it would guess for the union, so its cost estimate stays below
    -- jit_above_cost; JIT compilation would take longer than the query itself
    FROM unnest((SELECT queues FROM named)) AS named (queue)
    CROSS JOIN LATERAL (
        -- the first %(cap)s + 1 messages that are not delayed, in delivery order
        SELECT
            count(*) AS seen,
            count(*) FILTER (
                WHERE first.lease IS NOT NULL
                  AND first.next_iteration > coalesce(%(now)s::timestamptz, now())
            ) AS leased
        FROM (
            SELECT m.lease, m.next_iteration
            FROM {schema}.message_store AS m
            WHERE m.queue = named.queue
              AND NOT m.delayed
            ORDER BY m.priority DESC, m.id
            LIMIT %(cap)s::bigint + 1
        ) AS first
    ) AS visible
    CROSS JOIN LATERAL (
        SELECT count(*) AS seen
        FROM (
            SELECT 1
            FROM {schema}.dead_letter AS d
            WHERE d.queue = named.queue
            ORDER BY d.died_at
            LIMIT %(cap)s::bigint + 1
        ) AS first
    ) AS dead
    CROSS JOIN LATERAL (
        -- The oldest ready message, and the leased messages in front of the first ready
        -- one of each priority: claims take messages in delivery order, so that is where
        -- leases are. Counted from the index, up to %(cap)s per priority.
        SELECT min(head.created_at) AS oldest_ready, sum(leased.seen)::bigint AS leased
        FROM head
        CROSS JOIN LATERAL (
            SELECT count(*) AS seen
            FROM (
                SELECT 1
                FROM {schema}.message_store AS m
                WHERE m.queue = head.queue
                  AND NOT m.delayed
                  AND m.priority = head.priority
                  AND m.id < CASE
                      WHEN head.ready_priority = head.priority THEN head.id
                      ELSE 9223372036854775807
                  END
                LIMIT %(cap)s::bigint + 1
            ) AS first
        ) AS leased
        WHERE head.queue = named.queue
    ) AS front
    LEFT JOIN delayed_seen ON delayed_seen.queue = named.queue
    LEFT JOIN queue_freq AS message_freq ON message_freq.tablename = 'message'
    LEFT JOIN queue_freq AS dead_freq ON dead_freq.tablename = 'dead_letter'
),
delayed_counted AS (
    SELECT
        counted.*,
        delayed_total.seen <= %(cap)s AS delayed_exact,
        CASE
            WHEN delayed_total.seen <= %(cap)s THEN counted.delayed_seen
            -- beyond the cap, for a common queue whose other messages were all counted:
            -- its estimated rows less those
            WHEN counted.visible_seen <= %(cap)s AND counted.common_estimate IS NOT NULL
                THEN greatest(
                    round(counted.common_estimate)::bigint - counted.visible_seen,
                    counted.delayed_seen
                )
            -- else the delayed total shared out as in the sample
            ELSE greatest(
                round(
                    greatest(delayed_total.estimate, delayed_total.seen)
                    * counted.delayed_seen / delayed_total.seen
                )::bigint,
                counted.delayed_seen
            )
        END AS delayed
    FROM counted
    CROSS JOIN delayed_total
)
SELECT
    queue,
    CASE
        WHEN visible_seen <= %(cap)s THEN visible_seen - leased
        -- beyond the cap: the queue's estimated rows less its delayed ones
        ELSE greatest(
            round(coalesce(message_estimate, 0))::bigint - delayed, %(cap)s::bigint + 1
        ) - coalesce(front_leased, 0)
    END AS ready,
    CASE WHEN visible_seen <= %(cap)s THEN leased ELSE coalesce(front_leased, 0) END AS leased,
    delayed,
    CASE
        WHEN dead_seen <= %(cap)s THEN dead_seen
        ELSE greatest(round(coalesce(dead_estimate, 0))::bigint, %(cap)s::bigint + 1)
    END AS dead,
    visible_seen <= %(cap)s AS ready_exact,
    delayed_exact,
    dead_seen <= %(cap)s AS dead_exact,
    extract(EPOCH FROM coalesce(%(now)s::timestamptz, now()) - oldest_ready)::float8
        AS oldest_ready_age
FROM delayed_counted
ORDER BY queue;

-- name: table_sizes :many
-- Per broker table: bytes on disk (with indexes and TOAST), live and dead rows as the
-- server counts them, and seconds since it was last vacuumed. Catalog reads only.
-- 'message' is all the messages' storage: every generation of message_store (migration
-- 0012), and the previous version's table while it lasts; its vacuum age is the oldest.
SELECT
    CASE WHEN t.relname = 'dead_letter' THEN 'dead_letter' ELSE 'message' END AS relname,
    sum(pg_total_relation_size(t.relid))::bigint,
    sum(greatest(t.n_live_tup, 0))::bigint,
    sum(greatest(t.n_dead_tup, 0))::bigint,
    max(extract(
        EPOCH FROM coalesce(%(now)s::timestamptz, now())
            - greatest(t.last_vacuum, t.last_autovacuum)
    ))::float8
FROM pg_stat_user_tables AS t
WHERE t.schemaname = %(schema)s
  AND (
      t.relname IN ('message', 'dead_letter')
      OR t.relid IN (
          SELECT p.relid
          FROM pg_catalog.pg_partition_tree(
              to_regclass(format('%%I.message_store', %(schema)s::text))
          ) AS p
          WHERE p.isleaf
      )
  )
GROUP BY 1
ORDER BY 1;

-- name: generations :many
-- The storage's generations (migration 0012): state, bytes on disk, and for one whose
-- space waits (drained or emptied, not yet given back), the session whose lock keeps it
-- (pg_dump, say), for how many seconds, and what that session says it is. The session's
-- name and query are NULL where this role may not see them (pg_read_all_stats shows
-- them). Catalog reads only.
SELECT
    g.gen,
    g.state,
    coalesce(pg_total_relation_size(
        to_regclass(format('%%I.%%I', %(schema)s::text, g.relname))
    ), 0),
    g.blocked_by,
    extract(EPOCH FROM coalesce(%(now)s::timestamptz, now()) - g.blocked_since)::float8,
    a.application_name,
    a.backend_type
FROM {schema}.generation AS g
LEFT JOIN pg_stat_activity AS a ON a.pid = g.blocked_by
ORDER BY g.gen;
