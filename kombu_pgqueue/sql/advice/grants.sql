-- Statements pgqueue prints in its privilege errors for an administrator to run; never
-- executed by pgqueue. {database}, {schema} and {role} are composed with
-- psycopg.sql.Identifier, so the advice is quoted as PostgreSQL needs it. The same
-- statements are in docs/operations.md.

-- name: grant_create :none
GRANT CREATE ON DATABASE {database} TO {role};

-- name: grant_usage :none
-- A role that publishes or consumes in a schema another role owns: the queue's rows, and
-- only reading the applied versions (a role that could delete them would leave every
-- worker trying to migrate again). Tables are named, not ALL TABLES IN SCHEMA: a new one
-- is a decision, and tests/db/test_least_privilege.py fails until it is made.
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT SELECT, INSERT, UPDATE, DELETE
    ON {schema}.queue, {schema}.exchange, {schema}.binding, {schema}.message_store,
       {schema}.message, {schema}.dead_letter, {schema}.waiter, {schema}.listener,
       {schema}.periodic_entry, {schema}.periodic_leader
    TO {role};
GRANT SELECT
    ON {schema}.schema_migration, {schema}.handoff_key, {schema}.rotation, {schema}.generation
    TO {role};
GRANT USAGE, SELECT ON SEQUENCE {schema}.message_store_id_seq, {schema}.generation_seq TO {role};
GRANT EXECUTE ON FUNCTION {schema}.rotate TO {role};

-- name: grant_temporary :none
-- Bulk publishes (publish_many, send_many, Spark) stage rows with an ETA, a TTL queue or
-- a taken dedup key in a temporary table. PUBLIC has this unless it was revoked.
GRANT TEMPORARY ON DATABASE {database} TO {role};
