"""Small helpers shared by controllers."""

from __future__ import annotations

import re
from typing import Annotated, Any, Final

import msgspec
from litestar import Response
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.params import QueryParameter

from taskledger.events.errors import ValidationFailed
from taskledger.service.writer.commands import Stored

ID_PATTERN: Final = r"^[A-Za-z0-9._:-]{1,128}$"
_ID = re.compile(ID_PATTERN)

Id = Annotated[str, msgspec.Meta(pattern=ID_PATTERN)]

# The columns' ranges: a cursor past them is a 400 here, not an overflow in
# PostgreSQL. `seq` is a bigint; `stream_seq` an integer.
MAX_SEQ: Final = 2**62
MAX_STREAM_SEQ: Final = 2**31 - 1

SinceSeq = Annotated[int | None, QueryParameter(ge=0, le=MAX_SEQ, required=False)]
"""A cursor over the global `seq`."""
StreamSinceSeq = Annotated[int | None, QueryParameter(
    ge=0, le=MAX_STREAM_SEQ, required=False, description="a position in the stream (stream_seq)")]
"""A cursor over one stream's `stream_seq`."""


def check_id(value: str, what: str = "id") -> str:
    if not _ID.match(value):
        raise ValidationFailed(f"{what} must match [A-Za-z0-9._:-]{{1,128}}")
    return value


def split_types(types: str | None) -> list[str]:
    if not types:
        return []
    out = [t.strip() for t in types.split(",") if t.strip()]
    if len(out) > 50 or any(len(t) > 100 for t in out):
        raise ValidationFailed("types: at most 50 entries of at most 100 characters")
    return out


def respond(result: Any, status: int = 200) -> Response[Any]:
    if isinstance(result, Stored):
        return Response(content=result.body, status_code=result.status)
    return Response(content=result, status_code=status)


def _query_names(handler: BaseRouteHandler) -> set[str]:
    injected = handler.resolve_dependencies()  # `pool`, `settings`, ...: never from the query
    return {
        str(getattr(f.kwarg_definition, "query", None) or getattr(f.kwarg_definition, "name", None) or n)
        for n, f in handler.parsed_fn_signature.parameters.items() if n not in injected
    }


async def known_query_only(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """A guard: a query parameter the route does not take is refused (400), not ignored,
    so a misspelt filter never reads as "everything"."""
    if not connection.query_params:
        return
    unknown = sorted(set(connection.query_params) - _query_names(handler))
    if unknown:
        raise ValidationFailed(f"unknown query parameters: {', '.join(unknown)}")
