-- Webhooks: which events go to which URL, and how far each has been delivered.
-- Configuration, not facts: registering or removing a webhook writes no event.
CREATE TABLE webhooks (
    id          text        PRIMARY KEY,
    url         text        NOT NULL,
    types       text[]      NOT NULL,           -- the feed's filter; empty = every event
    format      text        NOT NULL CHECK (format IN ('event', 'issue')),
    secret      text        NOT NULL,           -- the HMAC key: kept to sign, never shown
    checkpoint  bigint      NOT NULL CHECK (checkpoint >= 0),  -- every match up to this seq is delivered
    created_by  text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- Every attempt to deliver one event, kept for operators (GET /webhooks/{id}/deliveries).
CREATE TABLE webhook_deliveries (
    id           bigserial        PRIMARY KEY,
    webhook_id   text             NOT NULL REFERENCES webhooks (id) ON DELETE CASCADE,
    seq          bigint           NOT NULL,
    event_type   text             NOT NULL,
    attempt      integer          NOT NULL CHECK (attempt > 0),
    ok           boolean          NOT NULL,
    status_code  integer,
    error        text,
    duration_ms  double precision NOT NULL,
    attempted_at timestamptz      NOT NULL DEFAULT now()
);
CREATE INDEX webhook_deliveries_latest ON webhook_deliveries (webhook_id, id DESC);
