-- A claim names its projects; without this index it walks the pending tasks
-- of every project in claim order until it finds ones of its own, so one
-- project's backlog slowed every other project's claims (measured by
-- bench/queue.py: 50 ms of PostgreSQL CPU per loop with 40,000 pending tasks
-- elsewhere).
CREATE INDEX tasks_claimable_by_project ON tasks (project, priority DESC, created_seq)
    WHERE state = 'pending' AND NOT is_parent;
