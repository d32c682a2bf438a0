"""Schema migrations: plain SQL files applied in name order (see service.migrate)."""
