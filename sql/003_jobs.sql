-- Jobs: the inline projection of the job:* streams, and the runners' leases.

-- One row per job, written in the same transaction as the job's events.
-- `body` is the whole JobState (events/jobs.py) and is a pure fold of the
-- job's events; the other columns are copies of it for filtering and claiming.
CREATE TABLE jobs (
    id               text        PRIMARY KEY,
    version          integer     NOT NULL,   -- stream_seq of the last event
    seq              bigint      NOT NULL,   -- global seq of the last event
    created_seq      bigint      NOT NULL,   -- global seq of job.created: FIFO order
    state            text        NOT NULL,
    project          text,
    node             text,
    worker           text,
    cancel_requested boolean     NOT NULL DEFAULT false,
    created_at       timestamptz NOT NULL,
    body             jsonb       NOT NULL
);

-- Claiming takes the oldest pending job, of any project or of some.
CREATE INDEX jobs_pending_fifo ON jobs (created_seq) WHERE state = 'pending';
CREATE INDEX jobs_pending_project_fifo ON jobs (project, created_seq) WHERE state = 'pending';
CREATE INDEX jobs_state_project ON jobs (state, project, created_seq);

-- The lease of a running (or cancelling) job. Not a projection: every report
-- pushes `expires_at` out without a new fact, so it is kept beside the view,
-- never in it. The row goes when the job ends. The sweeper fails jobs whose
-- lease has run out.
CREATE TABLE job_leases (
    job_id        text        PRIMARY KEY,
    lease_id      text        NOT NULL,
    node          text,
    worker        text        NOT NULL,
    lease_seconds integer     NOT NULL CHECK (lease_seconds > 0),
    expires_at    timestamptz NOT NULL,
    last_report_at timestamptz NOT NULL
);

CREATE INDEX job_leases_expiry ON job_leases (expires_at);
