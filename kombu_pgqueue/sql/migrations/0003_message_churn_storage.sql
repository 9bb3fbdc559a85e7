-- The message table is insert, update once (the claim), delete: it churns its whole
-- content over and over. Storage settings for that:
-- * VACUUM never truncates its empty tail. A queue that empties and fills again would
--   give the pages back only to extend the file again, and truncation takes an ACCESS
--   EXCLUSIVE lock that stalls every claim and ack while it scans back over the tail
--   (seen in the chaos snapshot scenario as claims waiting on Lock:relation).
-- * Autovacuum starts after 1 % of the rows (plus 1,000) are dead instead of 20 %, and
--   is not throttled: dead rows at the head are what every claim from the head steps
--   over until VACUUM removes them.
-- No fillfactor: the claim changes next_iteration, a key of message_delayed_idx, so its
-- update is never HOT and free space kept on each page would only make the table larger.
-- (0004_hot_claims moves that index off next_iteration and sets a fillfactor.)
ALTER TABLE {schema}.message SET (
    vacuum_truncate = false,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_cost_delay = 0
);
