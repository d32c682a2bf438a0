-- The dashboard's browser sessions are HMAC-signed cookies. The key is one
-- per deployment and lives here so that every replica signs and checks with
-- the same one (the service keeps no state of its own). The first replica to
-- start inserts it; the others read it. Deleting the row (and restarting)
-- rotates the key and signs every browser out.
CREATE TABLE ui_secrets (
    id         integer     PRIMARY KEY CHECK (id = 1),
    secret     bytea       NOT NULL CHECK (length(secret) >= 32),
    created_at timestamptz NOT NULL DEFAULT now()
);
