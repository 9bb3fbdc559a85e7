-- Why a message died, beyond its reason: the exception a consumer's callback raised
-- on it (reason consumer_error) or the error decoding its body (reason undecodable).
-- NULL for rejects and for messages over max_attempts. Adding a nullable column with
-- no default changes only the catalog: no rewrite, a brief ACCESS EXCLUSIVE lock.
ALTER TABLE {schema}.dead_letter ADD COLUMN error text;
