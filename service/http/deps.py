"""What a route handler may ask for, and the one container it comes from.

`Services` holds what the app's lifespan opens (service/http/app.py fills it,
one per app). `dependencies(services)` is the app's dependency map: each name
below is provided by reading the container, and a handler declares the ones it
uses as parameters of that name, typed with the matching alias:

    async def readyz(self, pool: PoolDep, writer: WriterDep, draining: DrainingDep) -> ...

The aliases are `NamedDependency` (injected by the parameter's name: never a
query parameter, never in the OpenAPI document) over `SkipValidation` (these
are the app's own objects, not client input: nothing to check per request).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeAlias

import asyncpg
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from litestar import Litestar
from litestar.di import NamedDependency, Provide
from litestar.params import SkipValidation

from taskledger.service.http.auth import Authenticator
from taskledger.service.http.live import Hub
from taskledger.service.http.sessions import Sessions
from taskledger.service.metrics import Metrics
from taskledger.service.ops.rebuilds import RebuildRun
from taskledger.service.ops.webhooks import Deliverer
from taskledger.service.settings import Settings
from taskledger.service.tokens import TokenStore
from taskledger.service.writer.commands import CommandRunner
from taskledger.service.writer.engine import Writer


class Services:
    """The app's long-lived objects. `settings` and `metrics` exist from the
    start; the rest is set by the lifespan before the first request."""

    pool: asyncpg.Pool
    writer: Writer
    command_runner: CommandRunner
    tokens: TokenStore
    hub: Hub
    sessions: Sessions
    audit_key: Ed25519PrivateKey
    webhooks: Deliverer

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.rebuilds: dict[str, RebuildRun] = {}
        # cancelled at shutdown (sweepers, token revalidation, rebuild runs)
        self.background: list[asyncio.Task[Any]] = []
        # called with the new head after each of this process's commits
        self.commit_listeners: list[Callable[[int], None]] = []
        # tried in order when a request carries no bearer token
        self.authenticators: list[Authenticator] = []
        # told to stop (SIGTERM): /readyz answers 503 while requests are still served
        self.draining = False


def services_of(app: Litestar) -> Services:
    """The container of `app`, for code that runs outside a handler (tests, tools)."""
    services = app.state.services
    assert isinstance(services, Services)
    return services


SettingsDep: TypeAlias = NamedDependency[SkipValidation[Settings]]
MetricsDep: TypeAlias = NamedDependency[SkipValidation[Metrics]]
PoolDep: TypeAlias = NamedDependency[SkipValidation[asyncpg.Pool]]
WriterDep: TypeAlias = NamedDependency[SkipValidation[Writer]]
CommandRunnerDep: TypeAlias = NamedDependency[SkipValidation[CommandRunner]]
TokensDep: TypeAlias = NamedDependency[SkipValidation[TokenStore]]
HubDep: TypeAlias = NamedDependency[SkipValidation[Hub]]
SessionsDep: TypeAlias = NamedDependency[SkipValidation[Sessions]]
AuditKeyDep: TypeAlias = NamedDependency[SkipValidation[Ed25519PrivateKey]]
RebuildsDep: TypeAlias = NamedDependency[SkipValidation[dict[str, RebuildRun]]]
BackgroundDep: TypeAlias = NamedDependency[SkipValidation[list[asyncio.Task[Any]]]]
DrainingDep: TypeAlias = NamedDependency[SkipValidation[bool]]


def dependencies(services: Services) -> dict[str, Provide]:
    """The app's dependency map: each name a handler may declare, read from `services`."""

    def settings() -> Settings:
        return services.settings

    def metrics() -> Metrics:
        return services.metrics

    def pool() -> asyncpg.Pool:
        return services.pool

    def writer() -> Writer:
        return services.writer

    def command_runner() -> CommandRunner:
        return services.command_runner

    def tokens() -> TokenStore:
        return services.tokens

    def hub() -> Hub:
        return services.hub

    def sessions() -> Sessions:
        return services.sessions

    def audit_key() -> Ed25519PrivateKey:
        return services.audit_key

    def rebuilds() -> dict[str, RebuildRun]:
        return services.rebuilds

    def background() -> list[asyncio.Task[Any]]:
        return services.background

    def draining() -> bool:
        return services.draining

    providers: list[Callable[[], Any]] = [settings, metrics, pool, writer, command_runner, tokens, hub, sessions,
                                          audit_key, rebuilds, background, draining]
    # Plain attribute reads: run inline, never in a worker thread.
    return {fn.__name__: Provide(fn, sync_to_thread=False) for fn in providers}
