-- Every statement the broker runs at run time. {schema} is composed with
-- psycopg.sql.Identifier; everything else is a %(named)s parameter. Each statement
-- runs alone in autocommit, so each one is its own transaction, and a NOTIFY it
-- sends goes out exactly when its rows become visible.
-- Time is a parameter (NULL = the server's clock), so tests move it instead of sleeping.
--
-- Publishes notify only a queue somebody waits for. A consumer's LISTEN session holds a
-- shared advisory lock on ({lock_waiting} 'pgqW', hashtext(channel || ':' || queue)) while it
-- waits for the queue (statement watch). A publish with gate (function notify_wanted,
-- migration 0007) first takes ({lock_publishing} 'pgqP', the same key) shared until its
-- commit, and then tries that key of 'pgqW' exclusively (and lets go at once): if it
-- can, nobody waits, and it sends no NOTIFY (whose commit would otherwise signal every
-- listening session of the database, and hold the cluster's notify lock across its WAL
-- flush). A consumer that starts waiting takes 'pgqW' first and then 'pgqP' exclusively
-- (watch_barrier), which waits for every publish that may have looked before it: those
-- have committed when its next claim runs. A publish that cannot take 'pgqP' (a
-- consumer is arming) notifies. Publishes in an application's transaction (gate false)
-- always notify: they must not hold 'pgqP' for as long as that transaction lasts. A
-- delayed message always notifies its due time ('d:'): every consumer, waiting or busy,
-- promotes due messages of the queues it consumes.
--
-- Handoff: a consumer that waits for a queue also has a row in table listener
-- (statement watch; migrations 0009, 0010). A publish with gate and %(handoff)s picks one
-- live waiter (CTE picked), leases the new row to it as a claim would, and the NOTIFY
-- tells that consumer ('h:<consumer>:...'), which delivers it with no claim, or hands it
-- back at once (statement release) if it cannot take it now. Any role that may connect
-- may LISTEN, so no payload holds a queue's name or a message: queues appear as their
-- random token (column queue.token), and a handed-off message as %(sealed)s, sealed by
-- the publishing client with the schema's key (table handoff_key; _handoffs.seal).

-- Generations (migration 0012): a statement on messages reads only the generations from
-- %(floor)s on: rotation.oldest as the client last read it (statement generation_floor;
-- it only grows, so an older value is safe, and reads a generation or two more). A
-- parameter, not a sub-select, so that the drained generations are pruned before the
-- statement starts, in any plan: pruned by a sub-select's value, each would still be
-- opened and set up, and a pg_dump that keeps them from being dropped made every claim
-- and publish pay for all of them (65 generations: a claim's candidates took 4x as long).

-- name: publish :one
-- One message. A due message wakes consumers ('r:' + the queue's token, column
-- queue.token: random, so a role that may LISTEN learns no queue names); a delayed one
-- tells them when it falls due ('d:' + epoch seconds), so they can sleep until then.
-- With %(handoff)s (set by the client: %(sealed)s holds the message and fits a NOTIFY
-- payload) and a consumer waiting, it is leased to that consumer as a claim would
-- (%(lease)s, attempts 1) and the NOTIFY hands it over ('h:', see payload below).
-- A message whose dedup key is taken is skipped (no row returned); publish_replacing
-- replaces the waiting one instead (one that a consumer holds is never replaced).
WITH wanted AS MATERIALIZED (
    -- whether a consumer waits for the queue (NULL: a delayed message, which announces
    -- its due time to every consumer instead)
    SELECT CASE
        WHEN NOT coalesce(%(eta)s::timestamptz > now(), false)
            THEN {schema}.notify_wanted(%(channel)s, %(queue)s, %(gate)s)
    END AS wanted
),
picked AS MATERIALIZED (
    -- one live waiter to hand the message to, if it may be handed off: from a random
    -- id on, two probes of waiter's primary key, whatever the number of waiters
    SELECT w.consumer, w.lease_seconds, w.secret
    FROM wanted
    CROSS JOIN LATERAL (
        (
            SELECT w.consumer, w.lease_seconds, w.secret
            FROM {schema}.listener AS w
            WHERE w.queue = %(queue)s
              -- a sub-select, evaluated once: an index condition (random() is not)
              AND w.consumer >= (SELECT left(md5(random()::text), 16))
            ORDER BY w.consumer
            LIMIT 1
        )
        UNION ALL
        (
            SELECT w.consumer, w.lease_seconds, w.secret
            FROM {schema}.listener AS w
            WHERE w.queue = %(queue)s
            ORDER BY w.consumer
            LIMIT 1
        )
        LIMIT 1
    ) AS w
    WHERE wanted.wanted
      AND %(handoff)s::boolean
      AND %(gate)s::boolean
      AND coalesce(%(expires_at)s::timestamptz > now(), true)
      -- its LISTEN session holds this lock exclusively while it lives
      AND NOT pg_try_advisory_xact_lock_shared({lock_consumer}, hashtext(w.consumer))
),
target AS MATERIALIZED (
    -- NULL: nobody waits (no NOTIFY); '': wake every consumer; else the waiter's id,
    -- the lease it renews (its visibility_timeout) and the secret that signs its handoffs
    SELECT
        coalesce(picked.consumer, CASE WHEN wanted.wanted THEN '' END) AS consumer,
        picked.lease_seconds,
        picked.secret
    FROM wanted
    LEFT JOIN picked ON true
),
fresh AS MATERIALIZED (
    -- the message as it is to be stored, inserted or (publish_replacing) written over
    -- the waiting one with its key
    SELECT
        coalesce(%(eta)s::timestamptz > now(), false) AS delayed,
        CASE WHEN target.consumer <> ''
            THEN now() + make_interval(secs => target.lease_seconds)
            ELSE coalesce(%(eta)s::timestamptz, now())
        END AS next_iteration,
        least(
            %(expires_at)s::timestamptz,
            now() + (SELECT q.message_ttl FROM {schema}.queue AS q WHERE q.name = %(queue)s)
        ) AS expires_at,
        -- a new message: a stale holder's ack must not delete what replaces it
        -- (handed off: the waiting consumer's lease)
        CASE WHEN target.consumer <> '' THEN %(lease)s::bigint END AS lease,
        CASE WHEN target.consumer <> '' THEN 1 ELSE 0 END AS attempts
    FROM target
),
replaced AS (
    -- the message it wrote over: none here; publish_replacing's UPDATE of the waiting
    -- message with its key. Not an UPDATE that a parameter turns off: never run, it
    -- was still set up over every generation, and cost each publish a tenth more of
    -- the server's CPU (benchmarks/HISTORY.md, 2026-11-29)
    -- unfilled: SELECT NULL::bigint AS id, NULL::boolean AS delayed, NULL::timestamptz AS next_iteration, NULL::bigint AS lease WHERE false
    {position}
),
inserted AS (
    -- a key that another waiting or running message holds: the trigger dedup_claim
    -- (migration 0011) skips the row, and no row comes back
    INSERT INTO {schema}.message_store (
        queue, priority, delayed, next_iteration, expires_at, dedup_key,
        body, content_type, content_encoding, headers, properties, lease, attempts
    )
    SELECT
        %(queue)s,
        %(priority)s,
        fresh.delayed,
        fresh.next_iteration,
        fresh.expires_at,
        %(dedup_key)s,
        %(body)s,
        %(content_type)s,
        %(content_encoding)s,
        %(headers)s::json,
        %(properties)s::json,
        fresh.lease,
        fresh.attempts
    FROM fresh
    WHERE NOT EXISTS (SELECT 1 FROM replaced)
    RETURNING id, delayed, next_iteration, lease
),
written AS (
    SELECT id, delayed, next_iteration, lease FROM inserted
    UNION ALL
    SELECT id, delayed, next_iteration, lease FROM replaced
)
SELECT
    written.id,
    CASE
        WHEN written.delayed THEN pg_notify(
            %(channel)s, 'd:' || extract(EPOCH FROM written.next_iteration)::text
        )
        WHEN written.lease IS NOT NULL THEN pg_notify(
            %(channel)s,
            -- h:<consumer>:<signature>:<message>, the signature the first 32 hex digits
            -- of sha256(secret || message || secret)
            'h:' || target.consumer
            || ':' || left(encode(sha256(convert_to(
                target.secret || handoff.message || target.secret, 'UTF8'
            )), 'hex'), 32)
            || ':' || handoff.message
        )
        WHEN target.consumer = '' THEN pg_notify(
            %(channel)s, 'r:' || coalesce((SELECT t.token FROM {schema}.queue AS t WHERE t.name = %(queue)s), '')
        )
    END
FROM written
CROSS JOIN target
CROSS JOIN LATERAL (
    -- <token>:<id>:<lease>:<lease end, epoch>:<the message, sealed by the client>; the
    -- client checked that the payload stays under NOTIFY's 8000 bytes
    SELECT CASE WHEN %(handoff)s::boolean AND written.lease IS NOT NULL THEN
        coalesce((SELECT t.token FROM {schema}.queue AS t WHERE t.name = %(queue)s), '')
            || ':' || written.id
            || ':' || written.lease
            || ':' || extract(EPOCH FROM written.next_iteration)
            || ':' || %(sealed)s::text
    END AS message
) AS handoff;

-- name: publish_replacing :one
-- extends: publish
-- The publish of a message with a dedup key that writes over the waiting message with
-- that key (Kombu's and Celery's dedup with replace), never over one a consumer holds.
UPDATE {schema}.message_store AS m
SET priority = %(priority)s,
    delayed = fresh.delayed,
    next_iteration = fresh.next_iteration,
    expires_at = fresh.expires_at,
    body = %(body)s,
    content_type = %(content_type)s,
    content_encoding = %(content_encoding)s,
    headers = %(headers)s::json,
    properties = %(properties)s::json,
    lease = fresh.lease,
    attempts = fresh.attempts
FROM fresh
WHERE m.queue = %(queue)s
  AND m.dedup_key = %(dedup_key)s
  AND m.gen >= %(floor)s::bigint
  AND (m.lease IS NULL OR m.next_iteration <= now())
RETURNING m.id, m.delayed, m.next_iteration, m.lease

-- name: publish_many :many
-- Many messages in one round trip, each column an array of the same length.
WITH inserted AS (
    INSERT INTO {schema}.message_store (
        queue, priority, delayed, next_iteration, expires_at, dedup_key,
        body, content_type, content_encoding, headers, properties
    )
    SELECT
        m.queue,
        m.priority,
        coalesce(m.eta > now(), false),
        coalesce(m.eta, now()),
        least(m.expires_at, now() + q.message_ttl),
        m.dedup_key,
        m.body,
        m.content_type,
        m.content_encoding,
        m.headers::json,
        m.properties::json
    FROM unnest(
        %(queue)s::text[],
        %(priority)s::smallint[],
        %(eta)s::timestamptz[],
        %(expires_at)s::timestamptz[],
        %(dedup_key)s::text[],
        %(body)s::bytea[],
        %(content_type)s::text[],
        %(content_encoding)s::text[],
        %(headers)s::text[],
        %(properties)s::text[]
    ) WITH ORDINALITY AS m (
        queue, priority, eta, expires_at, dedup_key,
        body, content_type, content_encoding, headers, properties, ord
    )
    LEFT JOIN {schema}.queue AS q ON q.name = m.queue
    -- ids follow the caller's order, and so does delivery
    ORDER BY m.ord
    -- a key another message holds: skipped by the trigger dedup_claim (migration 0011)
    RETURNING queue, delayed, next_iteration
),
wake AS (
    SELECT DISTINCT
        queue,
        CASE WHEN delayed
            THEN 'd:' || extract(EPOCH FROM min(next_iteration) FILTER (WHERE delayed) OVER ())::text
            ELSE 'r:' || coalesce((SELECT t.token FROM {schema}.queue AS t WHERE t.name = queue), '')
        END AS payload
    FROM inserted
)
SELECT
    (SELECT count(*) FROM inserted) AS inserted,
    CASE WHEN left(wake.payload, 2) = 'd:' OR {schema}.notify_wanted(%(channel)s, wake.queue, %(gate)s)
    THEN pg_notify(%(channel)s, wake.payload) END
FROM wake;

-- name: publish_routed :many
-- Routing happens here, against the shared bindings: one row per bound queue. Each
-- queue's copy is handed off, wakes, or announces its due time as publish's message.
WITH target AS (
    SELECT DISTINCT b.queue
    FROM {schema}.binding AS b
    JOIN {schema}.exchange AS e ON e.name = b.exchange
    WHERE b.exchange = %(exchange)s
      AND (
          e.type = 'fanout'
          OR (e.type = 'direct' AND b.routing_key = %(routing_key)s)
          OR (e.type = 'topic' AND %(routing_key)s ~ b.pattern)
      )
),
wanted AS MATERIALIZED (
    -- as publish's, for each queue reached
    SELECT
        target.queue,
        CASE
            WHEN NOT coalesce(%(eta)s::timestamptz > now(), false)
                THEN {schema}.notify_wanted(%(channel)s, target.queue, %(gate)s)
        END AS wanted
    FROM target
),
picked AS MATERIALIZED (
    -- as publish's, for each queue somebody waits for
    SELECT wanted.queue, w.consumer, w.lease_seconds, w.secret
    FROM wanted
    CROSS JOIN LATERAL (
        (
            SELECT w.consumer, w.lease_seconds, w.secret
            FROM {schema}.listener AS w
            WHERE w.queue = wanted.queue
              -- a sub-select, evaluated once: an index condition (random() is not)
              AND w.consumer >= (SELECT left(md5(random()::text), 16))
            ORDER BY w.consumer
            LIMIT 1
        )
        UNION ALL
        (
            SELECT w.consumer, w.lease_seconds, w.secret
            FROM {schema}.listener AS w
            WHERE w.queue = wanted.queue
            ORDER BY w.consumer
            LIMIT 1
        )
        LIMIT 1
    ) AS w
    WHERE wanted.wanted
      AND %(handoff)s::boolean
      AND %(gate)s::boolean
      AND coalesce(%(expires_at)s::timestamptz > now(), true)
      AND NOT pg_try_advisory_xact_lock_shared({lock_consumer}, hashtext(w.consumer))
),
waiting AS MATERIALIZED (
    -- as publish's target
    SELECT
        wanted.queue,
        coalesce(picked.consumer, CASE WHEN wanted.wanted THEN '' END) AS consumer,
        picked.lease_seconds,
        picked.secret
    FROM wanted
    LEFT JOIN picked ON picked.queue = wanted.queue
),
inserted AS (
    INSERT INTO {schema}.message_store (
        queue, priority, delayed, next_iteration, expires_at, dedup_key,
        body, content_type, content_encoding, headers, properties, lease, attempts
    )
    SELECT
        waiting.queue,
        %(priority)s,
        coalesce(%(eta)s::timestamptz > now(), false),
        CASE WHEN waiting.consumer <> ''
            THEN now() + make_interval(secs => waiting.lease_seconds)
            ELSE coalesce(%(eta)s::timestamptz, now())
        END,
        least(%(expires_at)s::timestamptz, now() + q.message_ttl),
        %(dedup_key)s,
        %(body)s,
        %(content_type)s,
        %(content_encoding)s,
        %(headers)s::json,
        %(properties)s::json,
        CASE WHEN waiting.consumer <> '' THEN %(lease)s::bigint END,
        CASE WHEN waiting.consumer <> '' THEN 1 ELSE 0 END
    FROM waiting
    LEFT JOIN {schema}.queue AS q ON q.name = waiting.queue
    -- a key another message holds: skipped by the trigger dedup_claim (migration 0011)
    RETURNING id, queue, delayed, next_iteration, lease
)
SELECT
    inserted.queue,
    CASE
        WHEN inserted.delayed THEN pg_notify(
            %(channel)s, 'd:' || extract(EPOCH FROM inserted.next_iteration)::text
        )
        WHEN inserted.lease IS NOT NULL THEN pg_notify(
            %(channel)s,
            -- as publish's
            'h:' || waiting.consumer
            || ':' || left(encode(sha256(convert_to(
                waiting.secret || handoff.message || waiting.secret, 'UTF8'
            )), 'hex'), 32)
            || ':' || handoff.message
        )
        WHEN waiting.consumer = '' THEN pg_notify(
            %(channel)s, 'r:' || coalesce((SELECT t.token FROM {schema}.queue AS t WHERE t.name = inserted.queue), '')
        )
    END
FROM inserted
JOIN waiting ON waiting.queue = inserted.queue
CROSS JOIN LATERAL (
    -- as publish's (%(handoff)s first, as there)
    SELECT CASE WHEN %(handoff)s::boolean AND inserted.lease IS NOT NULL THEN
        coalesce((SELECT t.token FROM {schema}.queue AS t WHERE t.name = inserted.queue), '')
            || ':' || inserted.id
            || ':' || inserted.lease
            || ':' || extract(EPOCH FROM inserted.next_iteration)
            || ':' || %(sealed)s::text
    END AS message
) AS handoff
-- no binding matched at all (not: every copy was a duplicate): one row, queue NULL
UNION ALL
SELECT NULL, NULL
WHERE NOT EXISTS (SELECT 1 FROM target);

-- name: claim :many
-- Lease up to %(limit)s ready messages of one queue, in priority then FIFO order.
-- A message that already had %(max_attempts)s deliveries goes to the dead letters
-- instead of out again, and comes back too, after the leased ones, marked dead (no
-- body): the consumer logs it, since nothing else would tell anyone.
WITH candidate AS MATERIALIZED (
    SELECT id, attempts, gen
    FROM {schema}.message_store
    WHERE queue = %(queue)s
      -- generations that hold nothing live are skipped, not walked (see the top)
      AND gen >= %(floor)s::bigint
      AND NOT delayed
      AND next_iteration <= coalesce(%(now)s::timestamptz, now())
      AND (expires_at IS NULL OR expires_at > coalesce(%(now)s::timestamptz, now()))
      -- from the head here; claim_after puts the consumer's position in its place
      {position}
      -- relax_consumer_commits: 'off' here spares this commit the WAL flush wait; a crash
      -- can then forget it, which only delivers a message again (NULL: the server's setting)
      AND (SELECT set_config('synchronous_commit',
                             coalesce(%(synchronous_commit)s, current_setting('synchronous_commit')),
                             true)) IS NOT NULL
    ORDER BY priority DESC, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
),
exhausted AS MATERIALIZED (
    SELECT ARRAY(
        SELECT c.id FROM candidate AS c WHERE c.attempts >= %(max_attempts)s
    ) AS ids
),
buried AS (
    -- into the dead letters (function bury_exhausted, migration 0015), only when a
    -- candidate had its max_attempts: a claim that buries nothing runs no DELETE, whose
    -- statement trigger (dedup_release) would otherwise run for every claim
    SELECT b.id, b.priority, b.attempts, b.headers
    FROM exhausted AS x
    CROSS JOIN LATERAL {schema}.bury_exhausted(x.ids, %(floor)s::bigint) AS b
    WHERE cardinality(x.ids) > 0
),
leased AS (
    UPDATE {schema}.message_store AS m
    SET next_iteration = coalesce(%(now)s::timestamptz, now())
                         + make_interval(secs => %(lease_seconds)s),
        attempts = m.attempts + 1,
        lease = %(lease)s
    -- no join to candidate: a list of ids is an index condition on the primary key of
    -- each generation, one probe per id, whatever the planner believes of the table's
    -- size (see ack_many) or of the candidates' number (joined, it took every candidate
    -- for each, from the generation's index: 100 x 100 rows for a claim of 100). The
    -- candidates are locked: their attempts are the rows'.
    WHERE m.id = ANY(ARRAY(
              SELECT c.id FROM candidate AS c WHERE c.attempts < %(max_attempts)s
          ))
      -- only the generations the candidates are in
      AND m.gen >= %(floor)s::bigint
  AND m.gen BETWEEN (SELECT min(gen) FROM candidate) AND (SELECT max(gen) FROM candidate)
    RETURNING m.id, m.priority, m.attempts, m.body, m.content_type,
              m.content_encoding, m.headers, m.properties
)
SELECT id, priority, attempts, body, content_type, content_encoding,
       headers::text, properties::text,
       -- seconds this statement took in the server, for Consumer.claimed (a slow head);
       -- the client's own clock would also count the time until it read the answer
       extract(EPOCH FROM clock_timestamp() - statement_timestamp())::float8 AS took,
       false AS dead
FROM leased
UNION ALL
SELECT id, priority, attempts, NULL, NULL, NULL, headers::text, NULL,
       extract(EPOCH FROM clock_timestamp() - statement_timestamp())::float8,
       true
FROM buried
ORDER BY dead, priority DESC, id;

-- name: claim_after :many
-- extends: claim
-- The claim of a consumer that resumes after its last claimed message (same priority,
-- larger id; see _resume.ResumePositions): this condition in place of claim's {position}. It is
-- part of the index condition even in the generic plan of the prepared statement, so
-- the scan starts there, past acked rows that an old snapshot keeps VACUUM from
-- removing, and nothing is planned per claim.
AND priority = %(after_priority)s::smallint AND id > %(after_id)s::bigint

-- name: claim_above :many
-- extends: claim
-- The claim that a resuming consumer sends every so often (_resume.ABOVE_SECONDS) in
-- place of claim_after: the messages of a higher priority than its position, which its
-- own range never reaches, from the head of their range of the index. A separate
-- statement, so that neither plan covers both ranges (one claim reading both, a
-- merge of two ordered scans, halved the drain under a dump: benchmarks/HISTORY.md).
AND priority > %(after_priority)s::smallint

-- name: take :many
-- For no-ack consumers (Celery's remote control and events): the message is gone
-- as it is handed out, as AMQP's no-ack delivery is.
WITH candidate AS MATERIALIZED (
    SELECT id, gen
    FROM {schema}.message_store
    WHERE queue = %(queue)s
      -- as claim's
      AND gen >= %(floor)s::bigint
      AND NOT delayed
      AND next_iteration <= coalesce(%(now)s::timestamptz, now())
      AND (expires_at IS NULL OR expires_at > coalesce(%(now)s::timestamptz, now()))
    ORDER BY priority DESC, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM {schema}.message_store AS m
-- as claim's exhausted
WHERE m.id = ANY(ARRAY(SELECT id FROM candidate))
  AND m.gen >= %(floor)s::bigint
  AND m.gen BETWEEN (SELECT min(gen) FROM candidate) AND (SELECT max(gen) FROM candidate)
RETURNING m.id, m.priority, m.attempts + 1, m.body, m.content_type,
          m.content_encoding, m.headers::text, m.properties::text;

-- name: ack :one
-- Fenced: only the delivery that holds the lease may delete the row.
DELETE FROM {schema}.message_store
WHERE id = %(id)s
  AND lease = %(lease)s
  -- the live generations only (see the top of this file)
  AND gen >= %(floor)s::bigint
  -- relax_consumer_commits: 'off' here spares this commit the WAL flush wait; a crash
  -- can then forget it, which only delivers a message again (NULL: the server's setting)
  AND (SELECT set_config('synchronous_commit',
                         coalesce(%(synchronous_commit)s, current_setting('synchronous_commit')),
                         true)) IS NOT NULL
RETURNING id;

-- name: ack_many :many
-- The rows are found by `m.id = ANY(ids)` on each generation's primary key, and each
-- one's lease is looked up in a hash of the (id, lease) pairs: no join, so no plan
-- can go wrong. Joined to the pairs, a planner that believed the table empty (VACUUM
-- ran while the queue was drained: zero live rows over many pages) joined in the other
-- order and scanned the whole primary key on every call (78 ms for 20 acks over 6,000
-- rows, chaos "snapshot"), and the generic plan (the broker's sessions plan once,
-- _pool.SESSION_SETTINGS) probed the key once per pair with the whole list as its
-- condition, sorting the list each time (0.9 ms for 100 acks, 0.3 now). `IS TRUE`
-- keeps the IN a filter (a hashed sub-plan) rather than a join. renew and release do
-- the same.
DELETE FROM {schema}.message_store AS m
WHERE m.id = ANY(%(ids)s::bigint[])
  AND ((m.id, m.lease) IN (
          SELECT held.id, held.lease
          FROM unnest(%(ids)s::bigint[], %(leases)s::bigint[]) AS held (id, lease)
      )) IS TRUE
  -- the live generations only (see the top of this file)
  AND m.gen >= %(floor)s::bigint
  -- relax_consumer_commits: 'off' here spares this commit the WAL flush wait; a crash
  -- can then forget it, which only delivers a message again (NULL: the server's setting)
  AND (SELECT set_config('synchronous_commit',
                         coalesce(%(synchronous_commit)s, current_setting('synchronous_commit')),
                         true)) IS NOT NULL
RETURNING m.id;

-- name: requeue :one
-- Visible again at once, at its old place in the queue.
UPDATE {schema}.message_store
SET next_iteration = coalesce(%(now)s::timestamptz, now()),
    lease = NULL
WHERE id = %(id)s
  AND lease = %(lease)s
  -- the live generations only (see the top of this file)
  AND gen >= %(floor)s::bigint
  -- relax_consumer_commits: 'off' here spares this commit the WAL flush wait; a crash
  -- can then forget it, which only delivers a message again (NULL: the server's setting)
  AND (SELECT set_config('synchronous_commit',
                         coalesce(%(synchronous_commit)s, current_setting('synchronous_commit')),
                         true)) IS NOT NULL
RETURNING id, pg_notify(%(channel)s, 'r:' || coalesce((SELECT t.token FROM {schema}.queue AS t WHERE t.name = queue), ''));

-- name: release :many
-- A consumer hands back what it held. Messages it never handed to its callback
-- (uncount true) do not count against max_attempts; those its callback had (restored
-- at shutdown or reconnect) keep their count, so a message that takes its consumer
-- down cannot come back forever.
WITH released AS (
    UPDATE {schema}.message_store AS m
    SET next_iteration = coalesce(%(now)s::timestamptz, now()),
        lease = NULL,
        attempts = CASE WHEN %(uncount)s THEN greatest(m.attempts - 1, 0) ELSE m.attempts END
    -- by key, each lease looked up in a hash of the pairs (see ack_many)
    WHERE m.id = ANY(%(ids)s::bigint[])
      AND ((m.id, m.lease) IN (
              SELECT held.id, held.lease
              FROM unnest(%(ids)s::bigint[], %(leases)s::bigint[]) AS held (id, lease)
          )) IS TRUE
      -- the live generations only (see the top of this file)
      AND m.gen >= %(floor)s::bigint
      -- relax_consumer_commits: 'off' here spares this commit the WAL flush wait; a crash
      -- can then forget it, which only delivers a message again (NULL: the server's setting)
      AND (SELECT set_config('synchronous_commit',
                             coalesce(%(synchronous_commit)s, current_setting('synchronous_commit')),
                             true)) IS NOT NULL
    RETURNING m.queue
)
SELECT released_queue.queue, pg_notify(%(channel)s, 'r:' || coalesce((SELECT t.token FROM {schema}.queue AS t WHERE t.name = released_queue.queue), ''))
FROM (SELECT DISTINCT queue FROM released) AS released_queue;

-- name: bury :one
-- Reject without requeue: into the dead letters with the reason.
WITH gone AS (
    DELETE FROM {schema}.message_store
    WHERE id = %(id)s
      AND lease = %(lease)s
      -- the live generations only (see the top of this file)
      AND gen >= %(floor)s::bigint
      -- relax_consumer_commits: 'off' here spares this commit the WAL flush wait; a crash
      -- can then forget it, which only delivers a message again (NULL: the server's setting)
      AND (SELECT set_config('synchronous_commit',
                             coalesce(%(synchronous_commit)s, current_setting('synchronous_commit')),
                             true)) IS NOT NULL
    RETURNING id, queue, priority, attempts, created_at, dedup_key, body,
              content_type, content_encoding, headers, properties
)
INSERT INTO {schema}.dead_letter (
    id, queue, priority, attempts, reason, error, created_at, dedup_key,
    body, content_type, content_encoding, headers, properties
)
SELECT id, queue, priority, attempts, %(reason)s, %(error)s, created_at, dedup_key,
       body, content_type, content_encoding, headers, properties
FROM gone
RETURNING id;

-- name: renew :many
-- A live consumer pushes its leases forward; a lease taken over by someone else
-- does not match and is left alone. A message held since two generations ago or more
-- (a long task) moves to the current one as its lease is renewed, so that it keeps no
-- old generation from being emptied (migration 0012).
UPDATE {schema}.message_store AS m
SET next_iteration = coalesce(%(now)s::timestamptz, now())
                     + make_interval(secs => %(lease_seconds)s),
    gen = (
        SELECT CASE WHEN m.gen < s.last_value - 1 THEN s.last_value ELSE m.gen END
        FROM {schema}.generation_seq AS s
    )
-- by key, each lease looked up in a hash of the pairs (see ack_many)
WHERE m.id = ANY(%(ids)s::bigint[])
  AND ((m.id, m.lease) IN (
          SELECT held.id, held.lease
          FROM unnest(%(ids)s::bigint[], %(leases)s::bigint[]) AS held (id, lease)
      )) IS TRUE
  -- the live generations only (see the top of this file)
  AND m.gen >= %(floor)s::bigint
  -- relax_consumer_commits: 'off' here spares this commit the WAL flush wait; a crash
  -- can then forget it, which only delivers a message again (NULL: the server's setting)
  AND (SELECT set_config('synchronous_commit',
                         coalesce(%(synchronous_commit)s, current_setting('synchronous_commit')),
                         true)) IS NOT NULL
RETURNING m.id;

-- name: poll :many
-- The consumer's slow safety poll, one round trip: make due delayed messages ready
-- (and wake everyone for them), keep this consumer's expiring queues alive, say
-- which of %(check)s (its queues it is not about to claim from anyway) have ready
-- messages, and when the next delayed one is due.
WITH due AS MATERIALIZED (
    SELECT id
    FROM {schema}.message_store
    WHERE delayed
      AND due_at <= coalesce(%(now)s::timestamptz, now())
      AND gen >= %(floor)s::bigint  -- see the top
    ORDER BY due_at
    LIMIT 1000
    FOR UPDATE SKIP LOCKED
),
promoted AS (
    -- = ANY(ARRAY(...)) keeps the plan on the primary key whatever the estimate
    UPDATE {schema}.message_store AS m
    SET delayed = false
    WHERE m.id = ANY(ARRAY(SELECT id FROM due))
      AND m.gen >= %(floor)s::bigint
    RETURNING m.queue
),
woken AS MATERIALIZED (
    SELECT promoted_queue.queue, pg_notify(%(channel)s, 'r:' || coalesce((SELECT t.token FROM {schema}.queue AS t WHERE t.name = promoted_queue.queue), ''))
    FROM (SELECT DISTINCT queue FROM promoted) AS promoted_queue
),
touched AS (
    UPDATE {schema}.queue
    SET used_at = coalesce(%(now)s::timestamptz, now())
    WHERE name = ANY(%(queues)s::text[])
      AND expires IS NOT NULL
    RETURNING name
)
SELECT woken.queue, NULL::float8 AS next_due
FROM woken
UNION ALL
SELECT ready.queue, NULL
FROM unnest(%(check)s::text[]) AS ready (queue)
WHERE EXISTS (
    SELECT 1
    FROM {schema}.message_store AS m
    WHERE m.queue = ready.queue
      AND m.gen >= %(floor)s::bigint  -- as claim's
      AND NOT m.delayed
      AND m.next_iteration <= coalesce(%(now)s::timestamptz, now())
      AND (m.expires_at IS NULL OR m.expires_at > coalesce(%(now)s::timestamptz, now()))
)
UNION ALL
SELECT NULL, extract(EPOCH FROM min(m.due_at))::float8
FROM {schema}.message_store AS m
WHERE m.delayed
  AND m.due_at > coalesce(%(now)s::timestamptz, now())
  AND m.gen >= %(floor)s::bigint;

-- name: sweep :one
-- Garbage collection, run now and then by consumers: expired messages go (as on
-- RabbitMQ, a message past its TTL is dropped), and so do queues unused for longer
-- than their x-expires (at least %(min_expires)s seconds), with their messages and
-- bindings.
WITH expired_message AS (
    DELETE FROM {schema}.message_store
    WHERE expires_at <= coalesce(%(now)s::timestamptz, now())
      AND gen >= %(floor)s::bigint
      AND (lease IS NULL OR next_iteration <= coalesce(%(now)s::timestamptz, now()))
    RETURNING id
),
expired_queue AS (
    DELETE FROM {schema}.queue
    WHERE expires IS NOT NULL
      AND used_at + greatest(expires, make_interval(secs => %(min_expires)s))
          < coalesce(%(now)s::timestamptz, now())
    RETURNING name
),
unbound AS (
    DELETE FROM {schema}.binding AS b
    USING expired_queue AS q
    WHERE b.queue = q.name
    RETURNING b.queue
),
emptied AS (
    DELETE FROM {schema}.message_store AS m
    USING expired_queue AS q
    WHERE m.queue = q.name
    RETURNING m.id
)
SELECT
    (SELECT count(*) FROM expired_message) AS expired_messages,
    (SELECT count(*) FROM expired_queue) AS expired_queues,
    (SELECT count(*) FROM unbound) AS bindings,
    (SELECT count(*) FROM emptied) AS queue_messages;

-- name: generation_floor :one
-- The oldest generation that may hold a message: what the client passes as %(floor)s
-- (see the top) until it reads it again; and the current generation's number, bytes,
-- dead rows and VACUUMs so far (when to start the next one: _rotation.Policy and
-- CurrentGeneration). The statistics functions are PUBLIC's, like the
-- pg_stat_* views built on them.
SELECT
    r.oldest,
    c.gen,
    pg_total_relation_size(c.rel),
    pg_stat_get_dead_tuples(c.rel),
    pg_stat_get_vacuum_count(c.rel) + pg_stat_get_autovacuum_count(c.rel)
FROM {schema}.rotation AS r
CROSS JOIN LATERAL (
    SELECT
        s.last_value AS gen,
        {schema}.generation_table(s.last_value) AS rel
    FROM {schema}.generation_seq AS s
) AS c;

-- name: rotate_step :one
-- One step of the storage's rotation, %(step)s, by whichever consumer calls first
-- (function rotate_<step>, migration 0016, says what each does; _rotation takes them in
-- turn). Runs as the schema's owner.
SELECT rotated, moved, emptied, dropped
FROM {schema}.rotate(
    %(step)s, %(channel)s, %(max_age)s, %(min_age)s, %(dead_limit)s, %(batch)s,
    %(max_generations)s
);

-- name: rotate_repair :one
-- The generation sequence back at the current generation if a restore left it ahead
-- (function rotate_repair, migration 0016); before a process's first statement.
SELECT dropped
FROM {schema}.rotate('repair', '', 0, 0, 0, 0, 0);

-- name: declare_queue :one
INSERT INTO {schema}.queue (name, expires, message_ttl, max_priority)
VALUES (
    %(queue)s,
    make_interval(secs => %(expires)s),
    make_interval(secs => %(message_ttl)s),
    %(max_priority)s
)
ON CONFLICT (name) DO UPDATE
SET expires = excluded.expires,
    message_ttl = excluded.message_ttl,
    max_priority = excluded.max_priority,
    used_at = now()
RETURNING name;

-- name: queue_exists :one
SELECT EXISTS (SELECT 1 FROM {schema}.queue WHERE name = %(queue)s)
    OR EXISTS (SELECT 1 FROM {schema}.message_store WHERE queue = %(queue)s);

-- name: delete_queue :one
-- The queue, its bindings and every message, those consumers hold too (as RabbitMQ's
-- queue.delete); how many messages. With %(if_unused)s, nothing while a consumer uses
-- the queue (it holds a live lease on one of its messages, or waits for it: see
-- notify_wanted), and NULL.
WITH used AS MATERIALIZED (
    SELECT CASE WHEN %(if_unused)s::boolean THEN
        EXISTS (
            SELECT 1
            FROM {schema}.message_store
            WHERE queue = %(queue)s
              AND lease IS NOT NULL
              AND next_iteration > coalesce(%(now)s::timestamptz, now())
        )
        OR {schema}.notify_wanted(%(channel)s, %(queue)s, true)
    ELSE false END AS used
),
unbound AS (
    DELETE FROM {schema}.binding
    WHERE queue = %(queue)s
      AND NOT (SELECT used FROM used)
    RETURNING queue
),
emptied AS (
    DELETE FROM {schema}.message_store
    WHERE queue = %(queue)s
      AND NOT (SELECT used FROM used)
    RETURNING id
),
dropped AS (
    DELETE FROM {schema}.queue
    WHERE name = %(queue)s
      AND NOT (SELECT used FROM used)
    RETURNING name
)
SELECT CASE WHEN NOT (SELECT used FROM used) THEN (SELECT count(*) FROM emptied) END;

-- name: size :one
-- Messages waiting in the queue: ready or delayed, not held by a live lease.
SELECT count(*)
FROM {schema}.message_store
WHERE queue = %(queue)s
  AND (lease IS NULL OR next_iteration <= coalesce(%(now)s::timestamptz, now()));

-- name: purge :one
-- Removes waiting messages; messages held by a live lease stay with their consumer.
WITH purged AS (
    DELETE FROM {schema}.message_store
    WHERE queue = %(queue)s
      AND (lease IS NULL OR next_iteration <= coalesce(%(now)s::timestamptz, now()))
    RETURNING id
)
SELECT count(*) FROM purged;

-- name: declare_exchange :one
INSERT INTO {schema}.exchange (name, type)
VALUES (%(exchange)s, %(type)s)
ON CONFLICT (name) DO UPDATE
SET type = excluded.type
RETURNING name;

-- name: exchange_type :one
SELECT type FROM {schema}.exchange WHERE name = %(exchange)s;

-- name: delete_exchange :one
WITH unbound AS (
    DELETE FROM {schema}.binding WHERE exchange = %(exchange)s RETURNING queue
)
DELETE FROM {schema}.exchange WHERE name = %(exchange)s
RETURNING name;

-- name: bind :one
INSERT INTO {schema}.binding (exchange, routing_key, queue, pattern)
VALUES (%(exchange)s, %(routing_key)s, %(queue)s, %(pattern)s)
ON CONFLICT (exchange, routing_key, queue) DO UPDATE
SET pattern = excluded.pattern
RETURNING queue;

-- name: unbind :one
DELETE FROM {schema}.binding
WHERE exchange = %(exchange)s
  AND routing_key = %(routing_key)s
  AND queue = %(queue)s
RETURNING queue;

-- name: bindings :many
SELECT routing_key, pattern, queue
FROM {schema}.binding
WHERE exchange = %(exchange)s
ORDER BY routing_key, queue;

-- name: dead_letters :many
SELECT id, queue, priority, attempts, reason, created_at, died_at,
       body, content_type, content_encoding, headers::text, properties::text, error
FROM {schema}.dead_letter
WHERE (%(queue)s::text IS NULL OR queue = %(queue)s)
ORDER BY died_at, id
LIMIT %(limit)s;

-- name: requeue_dead :many
-- Dead letters back into their queue as new deliveries (attempts start again). One
-- whose dedup key a live message holds meanwhile stays dead, rather than run twice.
WITH revived AS (
    DELETE FROM {schema}.dead_letter AS d
    WHERE d.id = ANY(%(ids)s::bigint[])
      AND NOT EXISTS (
          SELECT 1
          FROM {schema}.message_store AS m
          WHERE m.queue = d.queue
            AND m.dedup_key = d.dedup_key
      )
    RETURNING d.id, d.queue, d.priority, d.dedup_key, d.body, d.content_type,
              d.content_encoding, d.headers, d.properties
),
inserted AS (
    INSERT INTO {schema}.message_store (
        queue, priority, dedup_key, body, content_type, content_encoding, headers, properties
    )
    SELECT queue, priority, dedup_key, body, content_type, content_encoding, headers, properties
    FROM revived
    ORDER BY id
    RETURNING queue
)
SELECT revived_queue.queue, pg_notify(%(channel)s, 'r:' || coalesce((SELECT t.token FROM {schema}.queue AS t WHERE t.name = revived_queue.queue), ''))
FROM (SELECT DISTINCT queue FROM inserted) AS revived_queue;

-- name: purge_dead :one
WITH purged AS (
    DELETE FROM {schema}.dead_letter
    WHERE (%(queue)s::text IS NULL OR queue = %(queue)s)
    RETURNING id
)
SELECT count(*) FROM purged;

-- name: queue_stats :many
-- Per queue: waiting now, waiting for an ETA, held by a live lease, dead, and the
-- age of the oldest waiting message. Reads the whole table: for operators and
-- monitors, not the hot path.
WITH live AS (
    SELECT
        queue,
        count(*) FILTER (
            WHERE NOT delayed AND (lease IS NULL OR next_iteration <= now())
        ) AS ready,
        count(*) FILTER (WHERE delayed) AS delayed,
        count(*) FILTER (WHERE lease IS NOT NULL AND next_iteration > now()) AS leased,
        min(created_at) FILTER (
            WHERE NOT delayed AND (lease IS NULL OR next_iteration <= now())
        ) AS oldest_ready
    FROM {schema}.message_store
    GROUP BY queue
),
dead AS (
    SELECT queue, count(*) AS dead
    FROM {schema}.dead_letter
    GROUP BY queue
),
named AS (
    SELECT queue FROM live
    UNION
    SELECT queue FROM dead
    UNION
    SELECT name FROM {schema}.queue
)
SELECT
    named.queue,
    coalesce(live.ready, 0),
    coalesce(live.delayed, 0),
    coalesce(live.leased, 0),
    coalesce(dead.dead, 0),
    extract(EPOCH FROM now() - live.oldest_ready)::float8
FROM named
LEFT JOIN live ON live.queue = named.queue
LEFT JOIN dead ON dead.queue = named.queue
ORDER BY named.queue;

-- name: dead_letter :one
SELECT id, queue, priority, attempts, reason, created_at, died_at,
       body, content_type, content_encoding, headers::text, properties::text, error
FROM {schema}.dead_letter
WHERE id = %(id)s;

-- name: create_staging :none
-- Per-session staging table for COPY; emptied by every commit.
CREATE TEMPORARY TABLE IF NOT EXISTS pgqueue_staging (
    ord bigint GENERATED ALWAYS AS IDENTITY,
    queue text,
    priority smallint,
    eta timestamptz,
    expires_at timestamptz,
    dedup_key text,
    body bytea,
    content_type text,
    content_encoding text,
    headers text,
    properties text
) ON COMMIT DELETE ROWS;

-- name: copy_staging :none
COPY pgqueue_staging (
    queue, priority, eta, expires_at, dedup_key,
    body, content_type, content_encoding, headers, properties
) FROM STDIN;

-- name: copy_staging_binary :none
-- The same in binary: half the client's CPU, and no text parsing on the server. The
-- client must send exactly the staging column types (text, int2, timestamptz, bytea).
COPY pgqueue_staging (
    queue, priority, eta, expires_at, dedup_key,
    body, content_type, content_encoding, headers, properties
) FROM STDIN WITH (FORMAT BINARY);

-- name: ttl_queues :many
-- Which of these queues cut a message's life short (x-message-ttl): their messages
-- take the staging path, whose INSERT applies the TTL.
SELECT name
FROM {schema}.queue
WHERE name = ANY(%(queues)s::text[])
  AND message_ttl IS NOT NULL;

-- name: copy_direct :none
-- A bulk load's fast path, straight into the queue table: for messages without an
-- ETA, into queues without a TTL, whose defaults (visible now, not delayed) are
-- right. A row whose dedup key is taken does not go in: trigger dedup_claim
-- (migration 0011) skips it, and the rest of the COPY goes on.
COPY {schema}.message_store (
    queue, priority, expires_at, dedup_key,
    body, content_type, content_encoding, headers, properties
) FROM STDIN;

-- name: copy_direct_binary :none
-- The same in binary (text bytes are json's binary form as well).
COPY {schema}.message_store (
    queue, priority, expires_at, dedup_key,
    body, content_type, content_encoding, headers, properties
) FROM STDIN WITH (FORMAT BINARY);

-- name: notify_ready :many
-- Wake consumers of queues that a direct COPY filled; sent at commit.
SELECT
    CASE WHEN {schema}.notify_wanted(%(channel)s, ready.queue, %(gate)s)
    THEN pg_notify(%(channel)s, 'r:' || coalesce((SELECT t.token FROM {schema}.queue AS t WHERE t.name = ready.queue), '')) END
FROM unnest(%(queues)s::text[]) AS ready (queue);

-- name: publish_staged :many
-- What COPY staged, into the queue; COPY itself cannot skip dedup-key conflicts.
WITH inserted AS (
    INSERT INTO {schema}.message_store (
        queue, priority, delayed, next_iteration, expires_at, dedup_key,
        body, content_type, content_encoding, headers, properties
    )
    SELECT
        m.queue,
        m.priority,
        coalesce(m.eta > now(), false),
        coalesce(m.eta, now()),
        least(m.expires_at, now() + q.message_ttl),
        m.dedup_key,
        m.body,
        m.content_type,
        m.content_encoding,
        m.headers::json,
        m.properties::json
    FROM pgqueue_staging AS m
    LEFT JOIN {schema}.queue AS q ON q.name = m.queue
    -- ids follow the order of the COPY, and so does delivery; a load that does not
    -- need it (Spark partitions) passes ordered = false, and the planner drops the
    -- sort of the whole batch (a third of the INSERT's time at 125,000 rows)
    ORDER BY CASE WHEN %(ordered)s::boolean THEN m.ord END
    -- a key another message holds: skipped by the trigger dedup_claim (migration 0011)
    RETURNING queue, delayed, next_iteration
),
wake AS (
    SELECT DISTINCT
        queue,
        CASE WHEN delayed
            THEN 'd:' || extract(EPOCH FROM min(next_iteration) FILTER (WHERE delayed) OVER ())::text
            ELSE 'r:' || coalesce((SELECT t.token FROM {schema}.queue AS t WHERE t.name = queue), '')
        END AS payload
    FROM inserted
)
SELECT
    (SELECT count(*) FROM inserted) AS inserted,
    CASE WHEN left(wake.payload, 2) = 'd:' OR {schema}.notify_wanted(%(channel)s, wake.queue, %(gate)s)
    THEN pg_notify(%(channel)s, wake.payload) END
FROM wake;

-- name: schema_owner :one
-- Who owns the broker's schema, if it exists: only that role may upgrade it (a role
-- refused a migration is told whom to ask).
SELECT n.nspowner::regrole::text
FROM pg_catalog.pg_namespace AS n
WHERE n.nspname = %(schema)s;

-- name: schema_installed :one
-- Whether the broker's schema is in the database of an application connection that
-- transaction() enlisted: a transaction cannot span two databases.
SELECT EXISTS (
    SELECT 1
    FROM pg_catalog.pg_class AS c
    JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
    WHERE n.nspname = %(schema)s
      AND c.relname = 'message_store'
);

-- name: writable :one
-- Whether this server takes the broker's writes: not a standby, not read-only.
SELECT NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off';

-- name: database_identity :one
-- Which database of which running server a connection reaches: transaction() compares an
-- application's connection with the broker's. Every role may read these, and they are
-- the server's own, the same through PgBouncer or any address. A server restored from a
-- copy of another has the other's system identifier and oids, but not its start time.
SELECT
    current_database() AS name,
    d.oid AS oid,
    (SELECT system_identifier FROM pg_catalog.pg_control_system()) AS system,
    pg_catalog.pg_postmaster_start_time() AS started,
    host(inet_server_addr()) AS address,
    inet_server_port() AS port
FROM pg_catalog.pg_database AS d
WHERE d.datname = current_database();

-- name: listener_alive :none
-- A LISTEN session's mark that its consumer (the id it registers as a waiter) lives,
-- until the session ends (see statement publish, migration 0009).
SELECT pg_advisory_lock({lock_consumer}, hashtext(%(consumer)s::text));

-- name: handoff_key :one
-- The schema's key, which seals handoffs (migration 0010; _handoffs.seal): read once by
-- each publishing store and each LISTEN session.
SELECT key FROM {schema}.handoff_key;

-- name: watch :many
-- A consumer's LISTEN session starts waiting for these queues: publishes to them notify
-- from now on (see the top of this file). Session locks, gone with the session. Of
-- %(takes)s (those it may take a handed-off message from) it becomes a waiter, and
-- removes the waiters of these queues whose session is gone on the way. Returns each
-- queue's token, its name in notifications ('' for a queue not declared).
WITH gone AS (
    DELETE FROM {schema}.listener AS w
    WHERE w.queue = ANY(%(queues)s::text[])
      AND w.consumer <> %(consumer)s
      AND pg_try_advisory_xact_lock_shared({lock_consumer}, hashtext(w.consumer))
),
joined AS (
    INSERT INTO {schema}.listener (queue, consumer, lease_seconds, secret)
    SELECT DISTINCT q.name, %(consumer)s, %(lease_seconds)s::float8, %(secret)s
    FROM unnest(%(takes)s::text[]) AS q (name)
    ON CONFLICT DO NOTHING
)
SELECT
    q.name,
    coalesce((SELECT t.token FROM {schema}.queue AS t WHERE t.name = q.name), ''),
    pg_advisory_lock_shared({lock_waiting}, hashtext(%(channel)s::text || ':' || q.name))
FROM unnest(%(queues)s::text[]) AS q (name);

-- name: watch_barrier :none
-- Then waits for the publishes that looked for a waiting consumer before watch: they
-- hold 'pgqP' shared until they commit. In key order, so that two consumers arming at
-- once do not deadlock; the lock ends with this statement's own transaction.
SELECT pg_advisory_xact_lock({lock_publishing}, keys.k)
FROM (
    SELECT DISTINCT hashtext(%(channel)s::text || ':' || q.name) AS k
    FROM unnest(%(queues)s::text[]) AS q (name)
    ORDER BY 1
) AS keys;

-- name: unwatch :none
-- The consumer no longer waits for these queues (it has a backlog, or stopped).
WITH stopped AS (
    DELETE FROM {schema}.listener
    WHERE consumer = %(consumer)s
      AND queue = ANY(%(queues)s::text[])
)
SELECT pg_advisory_unlock_shared({lock_waiting}, hashtext(%(channel)s::text || ':' || q.name))
FROM unnest(%(queues)s::text[]) AS q (name);
