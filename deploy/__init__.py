"""Running taskledger past one process: the test topology (`python -m deploy.cluster`),
PostgreSQL primaries and standbys for it (`deploy.postgres`), and systemd units
for a real box (`deploy/systemd/`). See docs/OPERATIONS.md."""
