-- Projection checkpoints: which projections the writer advances with every batch.
--
-- An inline projection writes its rows in the same transaction as the events
-- that produce them, so after every commit it has folded the whole log: the
-- writer's head update (events.store.LogTx.finish) sets `seq` of every row
-- marked `inline` to the new head in the same statement. An async projection
-- (inline = false) moves its own row, with its own rows, as it folds.
-- `version` is the version of the fold that built the rows (set by a rebuild).

ALTER TABLE projection_checkpoints ADD COLUMN inline boolean NOT NULL DEFAULT false;

INSERT INTO projection_checkpoints (name, version, seq, inline)
SELECT n, 1, (SELECT seq FROM log_head WHERE id = 1), true
FROM unnest(ARRAY['tasks', 'blockers', 'jobs']) AS n
ON CONFLICT (name) DO UPDATE SET inline = true;
