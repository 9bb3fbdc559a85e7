-- Notifications that a stranger cannot read. PostgreSQL has no privilege on a LISTEN
-- channel: any role that may connect reads every payload on the broker's channel. Until
-- now a handoff carried its message in the clear, and a wakeup named its queue by an
-- unsalted MD5 prefix of the name, which confirms any guessed name. From this version:
--
-- * each queue has a random token, its name in wakeups ('r:<token>'); only roles that
--   may read table queue can tell which queue it is;
-- * a handoff's message is sealed (AES-256-GCM, by the publishing client) with the
--   schema's key, kept in table handoff_key, which only the broker's roles may read;
-- * consumers that open sealed handoffs register in table listener; table waiter is
--   left to the previous version's code, whose publishers keep handing messages in the
--   clear to their own consumers until they are upgraded (they never pick a consumer
--   of this version, nor does this version pick one of theirs).
--
-- Expand only: the previous version's statements keep working (queue gains a column
-- with a default; waiter stays). A later migration drops waiter.

-- 16 hex digits from the server's strong random source (gen_random_uuid); a new one
-- per queue row, so a queue deleted and declared again has a new token
ALTER TABLE {schema}.queue
    ADD COLUMN token text COLLATE "C" NOT NULL
    DEFAULT left(md5(gen_random_uuid()::text), 16);

CREATE TABLE {schema}.handoff_key (
    -- one row
    single boolean PRIMARY KEY DEFAULT true CHECK (single),
    -- 32 bytes (244 random bits from two gen_random_uuid); publishing clients seal
    -- handoffs with it, consumers open them
    key bytea NOT NULL CHECK (length(key) = 32)
);

INSERT INTO {schema}.handoff_key (key)
VALUES (sha256(convert_to(gen_random_uuid()::text || gen_random_uuid()::text, 'UTF8')));

-- As waiter (migration 0009), for consumers of this version.
CREATE UNLOGGED TABLE {schema}.listener (
    queue text NOT NULL,
    -- 16 random hex digits, a new id per LISTEN session
    consumer text COLLATE "C" NOT NULL,
    lease_seconds double precision NOT NULL,
    -- signs the handoffs to this consumer (see statement publish), so that a role that
    -- reads a handoff on the channel cannot address it to another consumer
    secret text NOT NULL,
    PRIMARY KEY (queue, consumer)
);

-- The roles granted waiter (those that publish or consume, docs/operations.md) get
-- the same on listener and may read the key, so that an upgrade needs no new grants.
-- The tables are found through their row types: no schema name inside a literal.
DO $migration_0010$
DECLARE
    granted record;
BEGIN
    FOR granted IN
        SELECT
            CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE a.grantee::regrole::text END AS role,
            string_agg(DISTINCT a.privilege_type, ', ') AS privileges
        FROM pg_catalog.pg_class AS c
        CROSS JOIN LATERAL aclexplode(c.relacl) AS a
        WHERE c.oid = (
                SELECT t.typrelid FROM pg_catalog.pg_type AS t
                WHERE t.oid = pg_typeof(NULL::{schema}.waiter)
            )
          AND a.grantee <> c.relowner
        GROUP BY a.grantee
    LOOP
        EXECUTE format(
            'GRANT %s ON TABLE %s TO %s',
            granted.privileges,
            (SELECT t.typrelid::regclass::text FROM pg_catalog.pg_type AS t
             WHERE t.oid = pg_typeof(NULL::{schema}.listener)),
            granted.role
        );
        EXECUTE format(
            'GRANT SELECT ON TABLE %s TO %s',
            (SELECT t.typrelid::regclass::text FROM pg_catalog.pg_type AS t
             WHERE t.oid = pg_typeof(NULL::{schema}.handoff_key)),
            granted.role
        );
    END LOOP;
END
$migration_0010$;
