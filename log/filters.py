"""The contract's feed filters as SQL: `types` (exact names, or prefixes ending
in '.'), `stream`, `project`, and a seq range. The one builder every feed read uses."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def type_filter_sql(types: Iterable[str], arg_index: int) -> tuple[str, list[Any]]:
    """SQL for the `types` filter: exact names, or prefixes ending in '.'."""
    types = list(types)
    exact = [t for t in types if not t.endswith(".")]
    prefixes = [t.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
                for t in types if t.endswith(".")]
    parts, args = [], []
    if exact:
        parts.append(f"type = ANY(${arg_index}::text[])")
        args.append(exact)
        arg_index += 1
    if prefixes:
        parts.append(f"type LIKE ANY(${arg_index}::text[])")
        args.append(prefixes)
    return "(" + " OR ".join(parts) + ")", args


def feed_where(
    first_arg: int, *, after: int | None = None, upto: int | None = None, types: Sequence[str] = (),
    stream: str | None = None, project: str | None = None,
) -> tuple[str, list[Any]]:
    """WHERE clauses joined with AND ("true" when none) and their arguments,
    numbered from `$first_arg`: seq > `after`, seq <= `upto`, then the filters."""
    clauses: list[str] = []
    args: list[Any] = []

    def arg(v: Any) -> str:
        args.append(v)
        return f"${first_arg + len(args) - 1}"

    if after is not None:
        clauses.append(f"seq > {arg(after)}")
    if upto is not None:
        clauses.append(f"seq <= {arg(upto)}")
    if stream is not None:
        clauses.append(f"stream = {arg(stream)}")
    if project is not None:
        clauses.append(f"meta->>'project' = {arg(project)}")
    if types:
        sql, targs = type_filter_sql(types, first_arg + len(args))
        clauses.append(sql)
        args.extend(targs)
    return (" AND ".join(clauses) or "true"), args
