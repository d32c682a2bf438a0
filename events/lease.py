"""Leases, for tasks and jobs alike: a worker is its token, on its node.

A lease is held by the token that claimed (its id and node, and the worker
name it carries). Every lease action sends its `Holder`; the `lease_id` alone
never suffices, and the node is checked on every action, not only at the claim.
"""

from __future__ import annotations

import msgspec

from taskledger.events.errors import LeaseMismatch


class Holder(msgspec.Struct, frozen=True, kw_only=True):
    """Who acts on a lease: the token's id, name and node, and the lease id it sent."""

    worker: str
    node: str | None
    token_id: str | None = None
    lease_id: str | None = None


class Lease(msgspec.Struct, frozen=True, kw_only=True):
    """Who holds a lease now (the fields of a task's or job's state)."""

    lease_id: str | None
    worker: str | None
    node: str | None
    token_id: str | None


def check_holder(lease: Lease, who: Holder, *, what: str, **extra: object) -> None:
    """Refuse (409 lease_mismatch) unless `who` holds `lease`.

    A lease recorded before leases named their token (token_id None) is held by
    the worker name and node alone.
    """
    if lease.lease_id is None or who.lease_id != lease.lease_id:
        raise LeaseMismatch(f"lease {who.lease_id!r} does not hold {what}", **extra)
    if lease.token_id is not None and who.token_id != lease.token_id:
        raise LeaseMismatch(f"{what} is leased to another token", **extra)
    if who.worker != lease.worker or who.node != lease.node:
        raise LeaseMismatch(f"{what} is leased to {lease.worker} on node {lease.node}", **extra)

