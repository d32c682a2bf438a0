"""The head of the log: the last committed `seq` and its hash, in the one row of `log_head`.

`head` reads it as it stands. `lock_head` reads it under the head lock
(`SELECT ... FOR UPDATE`), which every appender takes first and holds until
its commit: that lock is what makes seq order commit order (see
`taskledger.log.appending`). Only the append path and a projection's swap take it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Final, NamedTuple

from taskledger.events.canonical import GENESIS_HASH

HEAD_SEQ_SQL: Final = "(SELECT seq FROM log_head WHERE id = 1)"
"""The head's seq as a scalar subquery, for a statement that reads it in the same snapshot."""

_HEAD: Final = "SELECT seq, hash FROM log_head WHERE id = 1"
_LOCK: Final = "SELECT seq, hash, clock_timestamp() AS now FROM log_head WHERE id = 1 FOR UPDATE"


class Head(NamedTuple):
    seq: int
    hash: str


async def head(conn: Any) -> Head:
    """The head now (seq 0 and the genesis hash before the log's row exists)."""
    row = await conn.fetchrow(_HEAD)
    if row is None:
        return Head(0, GENESIS_HASH)
    return Head(int(row["seq"]), str(row["hash"]))


async def lock_head(conn: Any) -> tuple[Head, datetime]:
    """Take the head lock inside the caller's transaction: the head, and the
    database's clock read under the lock (so recorded_at rises with seq)."""
    row = await conn.fetchrow(_LOCK)
    if row is None:
        raise RuntimeError("log_head is missing: run migrations")
    return Head(int(row["seq"]), str(row["hash"])), row["now"]
