-- Dedup keys get a table of their own, the first step towards message storage that
-- rotates (issue 30): a unique index of a partitioned table must contain its partition
-- key, so once messages live in generations, no index on them can keep a key unique
-- across generations. A key is claimed in table dedup by a trigger on every insert,
-- whichever statement inserts (publish, publish_many, COPY's publish_staged, Spark,
-- a requeued dead letter): a message whose key another waiting or running message
-- holds is skipped, as ON CONFLICT DO NOTHING skipped it.
--
-- Additive: the previous version's statements keep their ON CONFLICT on
-- message_dedup_idx, which stays until the storage changes, and its inserts claim keys
-- through the same trigger, so both versions agree on which key is taken during a
-- rolling deploy.
CREATE TABLE {schema}.dedup (
    queue text NOT NULL,
    dedup_key text NOT NULL,
    -- the message that holds the key; the key is free again once that message is gone
    id bigint NOT NULL,
    PRIMARY KEY (queue, dedup_key)
);

-- Runs as the schema's owner, so that a role that may publish needs no grant on dedup
-- (docs/operations.md's roles are unchanged). Names are schema-qualified; search_path
-- is pinned so that no role can slip a table of its own in front of them.
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
        -- taken: by this very message (it moves between generations), by a message
        -- that still waits or runs (skip this one), or by one that is gone (take it);
        -- the row lock orders two publishers that would both take it
        SELECT d.id INTO holder
        FROM {schema}.dedup AS d
        WHERE d.queue = NEW.queue
          AND d.dedup_key = NEW.dedup_key
        FOR UPDATE;
        IF NOT FOUND THEN
            CONTINUE;  -- freed meanwhile: claim it again
        END IF;
        IF holder = NEW.id THEN
            RETURN NEW;
        END IF;
        IF EXISTS (SELECT 1 FROM {schema}.message AS m WHERE m.id = holder) THEN
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

-- A message that leaves (ack, reject, expiry, a purge) frees its key at once, so the
-- table holds about as many rows as there are messages with keys. Not when the same
-- message still exists: a move between generations deletes and inserts it.
CREATE FUNCTION {schema}.dedup_release()
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
      AND NOT EXISTS (SELECT 1 FROM {schema}.message AS m WHERE m.id = OLD.id);
    RETURN NULL;
END
$$;

-- WHEN is evaluated without calling the function: a message without a key costs
-- nothing more than before.
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

-- The keys already held. The trigger above exists from here on, in this transaction,
-- which holds message's SHARE ROW EXCLUSIVE lock: no insert slips between the two.
INSERT INTO {schema}.dedup (queue, dedup_key, id)
SELECT queue, dedup_key, id
FROM {schema}.message
WHERE dedup_key IS NOT NULL;
