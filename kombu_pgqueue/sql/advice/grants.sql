-- Statements pgqueue prints in its privilege errors for an administrator to run; never
-- executed by pgqueue. {database}, {schema} and {role} are composed with
-- psycopg.sql.Identifier, so the advice is quoted as PostgreSQL needs it.

-- name: grant_create :none
GRANT CREATE ON DATABASE {database} TO {role};

-- name: grant_usage :none
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {role};
