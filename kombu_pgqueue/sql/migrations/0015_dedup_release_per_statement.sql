-- Dedup keys freed once per statement (issues 30, 33). A message's key was freed by a
-- row trigger (migrations 0011, 0012, 0013): a PL/pgSQL call for every deleted message
-- with a key, which read the oldest generation and looked for the same message in the
-- live ones, since a move between generations (a partition-crossing UPDATE) fires the
-- row triggers of a DELETE. Celery's messages all have a key (its task id,
-- dedup_task_ids), so every ack of a Celery task paid for it: an ack of 17 cost the
-- server 30 us a message against 21 before the storage rotated, and 10.5 so
-- (benchmarks/HISTORY.md, 2026-11-29).
--
-- Now one trigger per statement frees the keys of every message the statement deleted
-- (its transition table, gone). A statement trigger of DELETE fires for DELETE
-- statements only: a move is an UPDATE, so the messages it moves keep their keys
-- without a look. A statement that deletes nothing still calls it once (an ack of
-- messages without keys: 1 to 2 us a message in acks of 17, against the 20 us an ack
-- of keyed messages saves). A claim, whose dead-letter branch would call it every time
-- though it rarely deletes anything, buries through function bury_exhausted, which it
-- calls only when there is something to bury. The previous version's table, message,
-- keeps its row trigger.
--
-- Replacing the trigger takes message_store's ACCESS EXCLUSIVE lock for a moment. It
-- waits at most lock_timeout (10 s when the session sets none) behind a reader such as
-- pg_dump, which holds the table to its end: every claim and publish would queue
-- behind the wait. The migration then stops with the holders named, and changes
-- nothing.

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

-- A claim's dead letters: the candidates that already had their max_attempts, from the
-- live generations into dead_letter. The claim (sql/queries.sql) calls it only when
-- there are some, so that a claim that buries nothing runs no DELETE, and the trigger
-- above does not run for every claim. As the claim's role.
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

-- dedup_claim reads the oldest generation only when a key is taken, not for every
-- message with a key (as migration 0013's, otherwise)
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

DO $migration_0015$
DECLARE
    waited text := current_setting('lock_timeout');
    holders text;
BEGIN
    IF waited = '0' THEN
        PERFORM set_config('lock_timeout', '10s', true);
    END IF;
    BEGIN
        DROP TRIGGER dedup_release ON {schema}.message_store;
    EXCEPTION WHEN lock_not_available THEN
        SELECT string_agg(DISTINCT format('%s (%s, since %s)', a.pid,
                                          coalesce(nullif(a.application_name, ''), a.usename),
                                          a.xact_start), ', ')
        INTO holders
        FROM pg_catalog.pg_locks AS l
        JOIN pg_catalog.pg_stat_activity AS a ON a.pid = l.pid
        WHERE l.relation = '{schema}.message_store'::regclass
          AND l.granted
          AND l.pid <> pg_backend_pid();
        RAISE EXCEPTION 'pgqueue: migration 0015 needs a moment''s exclusive lock on %.message_store, and other sessions held it for longer than lock_timeout (%): %',
            {schema}.schema_name(), current_setting('lock_timeout'), coalesce(holders, 'ended since')
            USING ERRCODE = 'lock_not_available',
                  HINT = 'Nothing was changed. Run migrate again once they have ended (a pg_dump holds its lock until it ends), or end them.';
    END;
    PERFORM set_config('lock_timeout', waited, true);
END
$migration_0015$;

CREATE TRIGGER dedup_release
AFTER DELETE ON {schema}.message_store
REFERENCING OLD TABLE AS gone
FOR EACH STATEMENT
EXECUTE FUNCTION {schema}.dedup_release_deleted();
