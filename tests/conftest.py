"""Fixtures: a real PostgreSQL (embedded by default, or TASKLEDGER_TEST_DATABASE_URL),
a fresh database per test cloned from a migrated template, the app in process,
and `taskledger serve` as a real server process."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase
from litestar.testing import AsyncTestClient

from taskledger.service.http.app import create_app
from taskledger.service.ops.embedded import with_database
from taskledger.service.ops.migrate import grant_app_role, migrate
from taskledger.service.settings import Settings

ADMIN_TOKEN = "test-admin-" + uuid.uuid4().hex

# Property tests: `ci` (the default) is derandomized, so a run is red or green
# by the code alone, with enough examples to find a four-step counterexample
# every time; `deep` (make deep) explores far more and keeps what fails.
settings.register_profile(
    "ci", derandomize=True, max_examples=400, stateful_step_count=40, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow])
# `mutation` (make mutation): as `ci` with half the examples, which still finds
# the re-verification defect (tests/oracle_probe.py), so a surviving mutant costs less.
settings.register_profile(
    "mutation", derandomize=True, max_examples=200, stateful_step_count=40, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "deep", max_examples=20_000, stateful_step_count=80, deadline=None,
    database=DirectoryBasedExampleDatabase(str(Path(__file__).resolve().parent.parent / ".hypothesis" / "examples")),
    suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
ROOT = Path(__file__).resolve().parent.parent
# One audit signing key for the session, outside the repository; checkpoints
# off unless a test asks for them, so tests that count events count theirs.
AUDIT_KEY = Path(tempfile.mkdtemp(prefix="tl-test-key-")) / "audit.pem"
AUDIT_KEY.write_bytes(Ed25519PrivateKey.generate().private_bytes(
    Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
NO_CHECKPOINTS: dict[str, Any] = {"audit_checkpoint_every_events": 0, "audit_checkpoint_every_seconds": 0}


# With TASKLEDGER_TEST_APP_ROLE set, the service under test (in process or as a
# server) connects as that role, made by `migrate --app-role` in the template:
# the suite then proves the service needs no more than that role may do. The
# fixtures themselves stay the database owner.
APP_ROLE = os.environ.get("TASKLEDGER_TEST_APP_ROLE") or None
_TEST_URLS: set[str] = set()


def as_app_role(url: str) -> str:
    """`url` connecting as the app role, when the suite runs as one and `url` is a `db_url`."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if not APP_ROLE or url not in _TEST_URLS:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, f"{APP_ROLE}@{host}", parts.path, parts.query, parts.fragment))


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """URL of a maintenance database on the server the tests use."""
    url = os.environ.get("TASKLEDGER_TEST_DATABASE_URL")
    if url:
        yield url
        return
    from taskledger.service.ops.embedded import start_embedded

    # Not under pytest's basetemp: pytest narrows that tree's permissions at
    # every session start, and the embedded server runs as its own system user.
    root = Path(tempfile.mkdtemp(prefix="tl-test-pg-"))
    handle, url = start_embedded(root)
    yield with_database(url, "postgres")
    handle.cleanup()
    shutil.rmtree(root, ignore_errors=True)


async def create_database(pg_url: str, name: str, template: str | None = None) -> None:
    c = await asyncpg.connect(pg_url)
    try:
        await c.execute(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
    finally:
        await c.close()


@pytest.fixture(scope="session")
def template_db(pg_url: str) -> Iterator[str]:
    name = "tl_template_" + uuid.uuid4().hex[:8]

    async def make() -> None:
        await create_database(pg_url, name)
        c = await asyncpg.connect(with_database(pg_url, name))
        try:
            await migrate(c)
            if APP_ROLE:
                await grant_app_role(c, APP_ROLE)
        finally:
            await c.close()

    _run(make())
    yield name
    _run(_drop(pg_url, name))


async def _drop(pg_url: str, name: str) -> None:
    c = await asyncpg.connect(pg_url)
    try:
        await c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await c.close()


def fresh_database(pg_url: str, template: str) -> str:
    name = "tl_" + uuid.uuid4().hex[:12]
    _run(create_database(pg_url, name, template))
    return name


@pytest.fixture
def db_url(pg_url: str, template_db: str) -> Iterator[str]:
    """A fresh, migrated database for one test."""
    name = fresh_database(pg_url, template_db)
    url = with_database(pg_url, name)
    _TEST_URLS.add(url)
    yield url
    _TEST_URLS.discard(url)
    _run(_drop(pg_url, name))


@pytest.fixture
async def pool(db_url: str) -> AsyncIterator[asyncpg.Pool]:
    p = await asyncpg.create_pool(db_url, min_size=1, max_size=20)
    try:
        yield p
    finally:
        await p.close()


def settings_for(db_url: str, **kw: Any) -> Settings:
    base: dict[str, Any] = {"database_url": as_app_role(db_url), "admin_token": ADMIN_TOKEN,
                            "migrate_on_start": False, "sweep_interval_seconds": 0.2, "audit_key": str(AUDIT_KEY),
                            **NO_CHECKPOINTS}
    base.update(kw)
    return Settings(**base)


class Client:
    """An in-process HTTP client holding one token."""

    def __init__(self, http: AsyncTestClient[Any], token: str | None) -> None:
        self.http = http
        self.token = token
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    async def get(self, path: str, **kw: Any) -> httpx.Response:
        return await self.http.get(path, headers={**self.headers, **kw.pop("headers", {})}, **kw)

    async def post(self, path: str, json: Any = None, **kw: Any) -> httpx.Response:
        return await self.http.post(path, json=json, headers={**self.headers, **kw.pop("headers", {})}, **kw)

    async def ok(self, r: Any, *codes: int) -> Any:
        assert r.status_code in (codes or (200, 201)), (
            f"{r.request.method} {r.request.url} -> {r.status_code} {r.text[:800]}")
        return r.json() if r.content else None


class AppHarness:
    def __init__(self, http: AsyncTestClient[Any], app: Any) -> None:
        self.http = http
        self.app = app
        self.admin = Client(http, ADMIN_TOKEN)

    async def client(self, role: str, node: str | None = None, name: str | None = None) -> Client:
        body: dict[str, Any] = {"role": role, "name": name or f"{role}-{uuid.uuid4().hex[:6]}"}
        if node is not None:
            body["node"] = node
        r = await self.admin.post("/tokens", body)
        assert r.status_code == 201, r.text
        return Client(self.http, r.json()["token"])

    def anonymous(self) -> Client:
        return Client(self.http, None)


@pytest.fixture
async def harness(db_url: str) -> AsyncIterator[AppHarness]:
    app = create_app(settings_for(db_url))
    async with AsyncTestClient(app=app, timeout=30) as http:
        yield AppHarness(http, app)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`taskledger serve` as a real process."""

    def __init__(self, db_url: str | None, *, data_dir: Path | None = None, server: str = "granian",
                 env: dict[str, str] | None = None, workers: int = 1) -> None:
        self.db_url = as_app_role(db_url) if db_url else db_url
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.data_dir = data_dir
        self.server = server
        self.workers = workers
        self.extra_env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"tl-serve-{self.port}.log"

    def start(self, timeout: float = 60) -> ServerProcess:
        cmd = [sys.executable, "-m", "taskledger.service.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--server", self.server, "--workers", str(self.workers)]
        env = {**os.environ, "TASKLEDGER_ADMIN_TOKEN": ADMIN_TOKEN,
               "TASKLEDGER_SWEEP_INTERVAL_SECONDS": "0.2", "TASKLEDGER_AUDIT_KEY": str(AUDIT_KEY),
               **{"TASKLEDGER_" + k.upper(): str(v) for k, v in NO_CHECKPOINTS.items()}, **self.extra_env}
        env.pop("TASKLEDGER_DATABASE_URL", None)
        if self.db_url:
            cmd += ["--database-url", self.db_url]
        if self.data_dir is not None:
            cmd += ["--data-dir", str(self.data_dir)]
        with self.log_path.open("ab") as logf:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logf,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited {self.proc.returncode}: {self.log()}")
            try:
                if httpx.get(self.base + "/readyz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("serve never became ready: " + self.log())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)

    def client(self, token: str = ADMIN_TOKEN) -> httpx.Client:
        return httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {token}"}, timeout=30)

    def token(self, role: str, node: str | None = None, name: str | None = None) -> str:
        body: dict[str, Any] = {"role": role, "name": name or f"{role}-{uuid.uuid4().hex[:6]}"}
        if node:
            body["node"] = node
        with self.client() as c:
            r = c.post("/tokens", json=body)
            assert r.status_code == 201, r.text
            return str(r.json()["token"])


@pytest.fixture
def server(db_url: str) -> Iterator[ServerProcess]:
    s = ServerProcess(db_url).start()
    try:
        yield s
    finally:
        s.stop()
