"""The HTTP side of authentication: the bearer header, the middleware that
turns it into a `Principal` (tokens are looked up through `TokenStore`, see
`taskledger.service.tokens`) and the role guard."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException, PermissionDeniedException
from litestar.handlers.base import BaseRouteHandler
from litestar.middleware import AbstractAuthenticationMiddleware, AuthenticationResult
from litestar.types import ASGIApp

from taskledger.service.tokens import Principal, TokenStore

PUBLIC_PATHS: Final = ("/healthz", "/readyz", "/metrics", "/schema", "/favicon.ico")


def bearer(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    header = connection.headers.get("authorization")
    if header:
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    return None


Authenticator = Callable[[ASGIConnection[Any, Any, Any, Any]], Awaitable[Principal | None]]
"""Another way in for a request without a bearer token (the dashboard's session cookie)."""


class AuthMiddleware(AbstractAuthenticationMiddleware):
    """A bearer token, else the first of `authenticators` that knows the caller.
    `tokens` is read per request: the store is opened by the app's lifespan."""

    def __init__(self, app: ASGIApp, *, tokens: Callable[[], TokenStore],
                 authenticators: Sequence[Authenticator], **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._tokens = tokens
        self._authenticators = authenticators

    async def authenticate_request(
        self, connection: ASGIConnection[Any, Any, Any, Any]
    ) -> AuthenticationResult:
        store = self._tokens()
        secret = bearer(connection)
        if secret is None:
            for fn in self._authenticators:
                p = await fn(connection)
                if p is not None:
                    return AuthenticationResult(user=p, auth=None)
            raise NotAuthorizedException("a bearer token is required")
        p = await store.lookup(secret)
        if p is None:
            raise NotAuthorizedException("unknown or revoked token")
        return AuthenticationResult(user=p, auth=secret)


def requires(*roles: str) -> Any:
    """A guard: the caller's role must be one of `roles` (admin always passes)."""

    allowed = frozenset(roles) | {"admin"}

    # async on purpose: Litestar runs a sync guard in a worker thread.
    async def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        user = connection.scope.get("user")
        if not isinstance(user, Principal):
            raise NotAuthorizedException("a bearer token is required")
        if user.role not in allowed:
            raise PermissionDeniedException(
                f"role {user.role!r} may not do this (needs one of {sorted(allowed)})"
            )

    return guard
