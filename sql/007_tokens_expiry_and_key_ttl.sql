-- Tokens may expire; idempotency keys are swept by age (Settings.idempotency_ttl_seconds).

ALTER TABLE tokens ADD COLUMN expires_at timestamptz;

CREATE INDEX idempotency_keys_created_at ON idempotency_keys (created_at);
