"""The task aggregate, pure: no I/O, no asyncpg, no Litestar.

- `events`: the facts (tagged frozen Structs) and their codec;
- `state`: `TaskState` and `evolve`;
- `rules`: one task's lifecycle (create, claim, lease actions, cancel, collect, escalate);
- `panel`: verification and the panel precedence;
- `rounds`: parents, rounds and their reviews;
- `reactions`: the rules that span tasks, in one table.
"""
