-- The task view, the blocker view and task leases.

CREATE TABLE tasks (
    id             text        PRIMARY KEY,
    project        text        NOT NULL,
    task_type      text        NOT NULL,
    state          text        NOT NULL,
    parent_task_id text,
    subtask_round  integer,
    is_parent      boolean     NOT NULL DEFAULT false,
    priority       integer     NOT NULL DEFAULT 0,
    assignee       text,
    node_blacklist text[]      NOT NULL DEFAULT '{}',
    maker_node     text,
    maker_worker   text,
    created_seq    bigint      NOT NULL,
    version        integer     NOT NULL,
    seq            bigint      NOT NULL,
    escalate_at    timestamptz,
    body           jsonb       NOT NULL
);

-- claim: the best pending task first, oldest first among equals
CREATE INDEX tasks_claimable ON tasks (priority DESC, created_seq)
    WHERE state = 'pending' AND NOT is_parent;
CREATE INDEX tasks_by_created ON tasks (created_seq);
CREATE INDEX tasks_by_project ON tasks (project, created_seq);
CREATE INDEX tasks_by_state ON tasks (state, created_seq);
CREATE INDEX tasks_by_parent ON tasks (parent_task_id, subtask_round) WHERE parent_task_id IS NOT NULL;
CREATE INDEX tasks_collectable ON tasks (project, seq)
    WHERE state IN ('completed', 'verified') AND task_type <> 'verify' AND NOT is_parent;
CREATE INDEX tasks_escalation ON tasks (escalate_at) WHERE escalate_at IS NOT NULL;

-- Leases are operational, not derived from events: heartbeats extend them
-- without an event. The claim that starts one is an event.
CREATE TABLE task_leases (
    task_id    text        PRIMARY KEY,
    lease_id   text        NOT NULL,
    worker     text        NOT NULL,
    node       text,
    lease_seconds integer  NOT NULL,
    expires_at timestamptz NOT NULL
);
CREATE INDEX task_leases_expiry ON task_leases (expires_at);

CREATE TABLE blockers (
    id           text    PRIMARY KEY,
    task_id      text    NOT NULL,
    project      text    NOT NULL,
    open         boolean NOT NULL,
    opened_seq   bigint  NOT NULL,
    resolved_seq bigint,
    body         jsonb   NOT NULL
);
CREATE INDEX blockers_open ON blockers (opened_seq) WHERE open;
CREATE INDEX blockers_task ON blockers (task_id);
