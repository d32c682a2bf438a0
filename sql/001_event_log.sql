-- The append-only event log, its head, and the guard that refuses changes.

CREATE TABLE events (
    seq         bigint      PRIMARY KEY,
    stream      text        NOT NULL,
    stream_seq  integer     NOT NULL CHECK (stream_seq > 0),
    type        text        NOT NULL,
    data        jsonb       NOT NULL,
    meta        jsonb       NOT NULL,
    recorded_at timestamptz NOT NULL,
    hash        text        NOT NULL,
    CONSTRAINT events_stream_position UNIQUE (stream, stream_seq)
);

CREATE INDEX events_project_seq ON events ((meta->>'project'), seq);
CREATE INDEX events_type_seq ON events (type text_pattern_ops, seq);

-- The single row every appender locks: last committed seq and its hash.
CREATE TABLE log_head (
    id   integer PRIMARY KEY CHECK (id = 1),
    seq  bigint  NOT NULL,
    hash text    NOT NULL
);
INSERT INTO log_head (id, seq, hash) VALUES (1, 0, repeat('0', 64));

CREATE FUNCTION events_refuse_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'the event log is append-only: % refused', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END
$$;

CREATE TRIGGER events_append_only
    BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW EXECUTE FUNCTION events_refuse_change();

CREATE TRIGGER events_no_truncate
    BEFORE TRUNCATE ON events
    FOR EACH STATEMENT EXECUTE FUNCTION events_refuse_change();

-- API tokens, stored as sha256 of the secret.
CREATE TABLE tokens (
    id          bigserial   PRIMARY KEY,
    name        text        NOT NULL,
    role        text        NOT NULL CHECK (role IN ('admin', 'producer', 'worker', 'reviewer', 'reader')),
    node        text,
    token_hash  text        NOT NULL UNIQUE,
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
);

-- First answers to requests sent with an Idempotency-Key, per token.
CREATE TABLE idempotency_keys (
    token_hash   text        NOT NULL,
    key          text        NOT NULL,
    request_hash text        NOT NULL,
    status       integer     NOT NULL,
    response     jsonb       NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (token_hash, key)
);

-- Where each projection stands in the log, written with its rows.
CREATE TABLE projection_checkpoints (
    name       text        PRIMARY KEY,
    version    integer     NOT NULL,
    seq        bigint      NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
