"""The WHERE clause the view reads share: each given filter becomes `expr $n`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def where(filters: Iterable[tuple[str, Any]], args: list[Any]) -> str:
    """`WHERE expr $n AND …` over the (expr, value) pairs whose value is not None, each
    value appended to `args` so that $n numbers it ("" when none is given). An expr ends
    in its operator: `t.state =`, `t.body->'labels' ?`."""
    clauses = []
    for expr, val in filters:
        if val is not None:
            args.append(val)
            clauses.append(f"{expr} ${len(args)}")
    return ("WHERE " + " AND ".join(clauses)) if clauses else ""
