-- Generations skipped before a statement starts (issue 30). Statements on messages
-- named the generations they read by sub-selects (rotation.oldest, the sequence's last
-- value), whose values are known only as the statement runs: every generation was
-- still opened and set up first, so while a pg_dump kept the drained ones from being
-- dropped, each claim and publish paid for all of them. The client's statements now take
-- the oldest generation as a parameter (%(floor)s, sql/queries.sql); the functions here
-- read it into a variable first, which PL/pgSQL passes to their statements as one.

-- An atomic task's ack (migration 0008), as ack_delivery and statement
-- ack_in_transaction run it: true when the delivery's lease still held its row.
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

CREATE OR REPLACE FUNCTION {schema}.ack_delivery(message_id bigint, lease_id bigint)
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

-- Dedup keys (migrations 0011, 0012): whether the key's holder is still there, in the
-- live generations only.
CREATE OR REPLACE FUNCTION {schema}.dedup_claim()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    holder bigint;
    floor bigint := (SELECT r.oldest FROM {schema}.rotation AS r);
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
                   WHERE m.id = holder AND m.gen >= floor)
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
