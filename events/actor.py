"""Who the service itself is in the log.

Everything taskledger appends on its own, with no request behind it (a lease
that ran out, an escalation, a job whose runner went quiet, a signed
checkpoint), records this one identity in its event's meta. Its role is no
token's role (tokens are admin, producer, worker, reviewer or reader), so no
caller can append under it.

Events recorded before the identity was one keep what they recorded: a task
sweep as role `admin`, a checkpoint as actor `taskledger`. Meta is free JSON,
so they read as before.
"""

from __future__ import annotations

from typing import Any, Final

SYSTEM_ACTOR: Final = "taskledger-sweeper"
SYSTEM_ROLE: Final = "system"


def system_meta() -> dict[str, Any]:
    """The meta of an event the service appends on its own."""
    return {"actor": SYSTEM_ACTOR, "role": SYSTEM_ROLE, "node": None}
