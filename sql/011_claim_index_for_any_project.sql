-- The claim across every project keeps tasks_claimable; a claim in one project
-- can no longer use it. Both indexes give claim order once `project = $2` is
-- one value, so the planner chose between them by cost alone, and with
-- statistics (after an ANALYZE) it took tasks_claimable and walked every other
-- project's pending tasks, filtering them out one by one: ~1 ms of PostgreSQL
-- a cycle in bench/queue.py's drains behind 150,000 pending tasks elsewhere,
-- 65 ms a loop in its loop step. `created_seq > 0` always holds; only the
-- claims across projects write it out, and nothing a one-project claim says
-- implies it, whether planned for its project or for any.
DROP INDEX tasks_claimable;
CREATE INDEX tasks_claimable ON tasks (priority DESC, created_seq)
    WHERE state = 'pending' AND NOT is_parent AND created_seq > 0;
