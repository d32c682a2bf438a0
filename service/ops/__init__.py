"""Operations: the embedded PostgreSQL, schema migrations, signing keys and background deliveries."""
