-- Dead letters keep their dedup key, so a requeued one blocks duplicates again.
-- Additive: code of the previous version neither reads nor writes the column.
ALTER TABLE {schema}.dead_letter ADD COLUMN dedup_key text;
