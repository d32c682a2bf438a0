-- The claim across every project keeps tasks_claimable; a claim in one project
-- can no longer use it. Both indexes give claim order once `project = $2` is
-- known to be one value, so a generic plan chose between them by cost alone,
-- and with statistics (after an ANALYZE) it took tasks_claimable and walked
-- every other project's pending tasks, filtering them out one by one: about
-- 1 ms of PostgreSQL a cycle in bench/queue.py's drains behind 200,000 pending
-- tasks elsewhere, 65 ms a loop in its loop step. The predicate's
-- `project <> ''` is written out by the any-project claim (projects are never
-- empty) and cannot be proved from `project = $2`, so a one-project claim has
-- only its project's index to walk.
DROP INDEX tasks_claimable;
CREATE INDEX tasks_claimable ON tasks (priority DESC, created_seq)
    WHERE state = 'pending' AND NOT is_parent AND project <> '';
