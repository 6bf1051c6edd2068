"""A private PgBouncer for the tests (the machine's package, 1.18 here): its own ini, userlist, log and port,
``pool_mode = transaction``, in front of the test server. Used by tests/test_pgbouncer.py, the model-based
suite's pooled scenarios and bench/pgbouncer.py."""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any

import psycopg
from sqlalchemy.engine import URL

from .brokers import _Server

#: Server connections of a test's main alias: fewer than the clients of most tests, so they share them.
POOL = 4


def pgbouncer_binary() -> str:
    found = shutil.which("pgbouncer") or (
        "/usr/sbin/pgbouncer" if os.path.exists("/usr/sbin/pgbouncer") else None
    )
    if found is None:
        raise RuntimeError("pgbouncer is not installed: apt-get install -y pgbouncer (.ci/run does)")
    return found


def pgbouncer_version() -> tuple[int, ...]:
    out = subprocess.run([pgbouncer_binary(), "--version"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"PgBouncer (\d+)\.(\d+)", out)
    assert found, out
    return tuple(int(x) for x in found.groups())


class PrivatePgBouncer(_Server):
    """A PgBouncer of this run's own: its ini, userlist and log in a temporary directory, a free port,
    ``pool_mode = transaction``, in front of the server of ``server`` (TCP host or Unix socket directory).

    ``databases`` maps each alias to ``(database, pool_size)``. Nothing of the machine's own pgbouncer
    service (``/etc/pgbouncer``, port 6432) is used or touched."""

    name = "pgbouncer"

    def __init__(self, server: URL, databases: dict[str, tuple[str, int]], **overrides: str) -> None:
        super().__init__()
        self.server = server
        host = server.host or server.query.get("host") or "127.0.0.1"
        self.host = host if isinstance(host, str) else host[0]
        user = server.username or "postgres"
        self.dir.chmod(0o755)  # read by the unprivileged user PgBouncer runs as
        dbs = [f"{alias} = host={self.host} port={server.port or 5432} dbname={db} pool_size={size}"
               for alias, (db, size) in databases.items()]  # fmt: skip
        settings = {
            "listen_addr": "127.0.0.1",
            "listen_port": str(self.port),
            "unix_socket_dir": "",
            "auth_type": "trust",
            "auth_file": str(self.dir / "userlist.txt"),
            "admin_users": user,
            "pool_mode": "transaction",
            "default_pool_size": str(POOL),
            "max_client_conn": "500",
            "server_login_retry": "1",
        }
        if pgbouncer_version() >= (1, 21):
            settings["max_prepared_statements"] = "0"  # as 1.18 behaves (later versions default to 200)
        settings.update(overrides)  # a test's own limits (max_client_conn, query_wait_timeout …)
        ini = ["[databases]", *dbs, "", "[pgbouncer]", *(f"{k} = {v}" for k, v in settings.items())]
        (self.dir / "pgbouncer.ini").write_text("\n".join(ini) + "\n")
        (self.dir / "userlist.txt").write_text(f'"{user}" "{server.password or ""}"\n')
        for f in ("pgbouncer.ini", "userlist.txt"):
            (self.dir / f).chmod(0o644)

    def command(self) -> Sequence[str]:
        as_user: list[str] = []
        if os.geteuid() == 0:  # "PgBouncer should not run as root": as the server's own user when the server
            # is a Unix socket (the embedded server's is in its data directory, closed to anyone else)
            owner = os.stat(self.host).st_uid if self.host.startswith("/") else None
            try:
                name = pwd.getpwuid(owner).pw_name if owner else pwd.getpwnam("postgres").pw_name
            except KeyError:
                name = "nobody"
            as_user = ["-u", name]
        return [pgbouncer_binary(), *as_user, str(self.dir / "pgbouncer.ini")]

    def url(self, alias: str, driver: str = "postgresql+psycopg") -> URL:
        return self.server.set(drivername=driver, host="127.0.0.1", port=self.port, database=alias, query={})

    def admin_connection(self) -> psycopg.Connection[Any]:
        """A connection to PgBouncer's admin console — kept by a caller that lowers ``max_client_conn``: at the
        limit PgBouncer takes no new connection, the admin's included, so the one that sets it back must be
        open already."""
        return psycopg.connect(psycopg.conninfo.make_conninfo(
            host="127.0.0.1", port=self.port, dbname="pgbouncer", user=self.server.username or "postgres"
        ), autocommit=True)  # fmt: skip

    def admin(self, command: str, conn: psycopg.Connection[Any] | None = None) -> list[dict[str, Any]]:
        """A command of PgBouncer's admin console (``SHOW SERVERS``, ``RECONNECT db``), on ``conn`` (from
        :meth:`admin_connection`) or a connection of its own."""
        with contextlib.nullcontext(conn) if conn is not None else self.admin_connection() as admin:
            cur = admin.execute(command.encode())
            if cur.description is None:
                return []
            names = [d.name for d in cur.description]
            return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]

    def server_pids(self, alias: str) -> list[int]:
        """The PostgreSQL backend pid of each server connection PgBouncer holds for ``alias``."""
        return [int(s["remote_pid"]) for s in self.admin("SHOW SERVERS") if s["database"] == alias]

    def log(self) -> str:
        return (self.dir / "out.log").read_text(errors="replace")
