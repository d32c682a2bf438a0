"""The job aggregate, pure: `events` (facts and codec), `state` (`JobState`, `evolve`,
status), `rules` (decisions). It imports neither asyncpg nor Litestar."""
