-- A lease belongs to the token that claimed it: heartbeats (which change no
-- state and so write no event) check the token as well as the worker and node.
ALTER TABLE task_leases ADD COLUMN token_id text;
