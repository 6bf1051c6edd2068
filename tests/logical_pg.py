"""A throwaway PostgreSQL cluster with ``wal_level=logical``, for the CDC tests and the CDC benchmark.

Logical decoding needs ``wal_level=logical``, a server setting that only a restart changes: the machine's
shared PostgreSQL (and the embedded one) must not be restarted for it, so this module starts a private
cluster of the machine's PostgreSQL binaries (``initdb`` + ``pg_ctl``, ``/usr/lib/postgresql/<N>/bin``, the
newest installed) on a free port, in its own temporary directory, and stops and deletes it afterwards.

PostgreSQL refuses to run as root: started by root, the cluster runs as the ``postgres`` system user (the
Debian packages create it), which then owns the temporary directory. Output plugins: ``test_decoding`` and
``pgoutput`` are built in; ``wal2json`` comes from Debian's ``postgresql-<N>-wal2json`` (``.ci/run`` installs
it when it is missing).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.engine import URL

from .brokers import free_port

__all__ = [
    "Change",
    "LogicalCluster",
    "Slot",
    "Transaction",
    "bin_dir",
    "logical_cluster",
    "lsn",
    "parse_pgoutput",
    "parse_wal2json",
]

#: Server settings of the throwaway cluster (everything else is initdb's default, fsync included, so that
#: measured figures are not flattered).
SETTINGS: dict[str, str] = {
    "wal_level": "logical",
    "max_replication_slots": "16",
    "max_wal_senders": "16",
    "listen_addresses": "127.0.0.1",
    "max_connections": "60",
    "shared_buffers": "64MB",
}


def bin_dir() -> Path:
    """The newest installed PostgreSQL's ``bin`` directory (Debian layout)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if not found:
        raise RuntimeError(
            "no PostgreSQL server binaries under /usr/lib/postgresql/*/bin: install the postgresql package "
            "(the CDC tests start a private cluster with wal_level=logical)"
        )
    return Path(found[-1]).parent


def _owner() -> str | None:
    """The user to run the server as: ``postgres`` when we are root, else ourselves (``None``)."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise RuntimeError(
            "running as root and there is no 'postgres' system user to run the throwaway cluster as "
            "(PostgreSQL refuses root): create one, or run the tests as a non-root user"
        ) from None
    return "postgres"


@dataclass
class LogicalCluster:
    """A running private cluster: ``url`` (user ``postgres``, database ``postgres``, trust authentication on
    127.0.0.1), ``port``, ``datadir`` and the server's ``log`` file."""

    root: Path
    port: int
    user: str | None

    @property
    def datadir(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    @property
    def url(self) -> URL:
        return URL.create(
            "postgresql+psycopg", username="postgres", host="127.0.0.1", port=self.port, database="postgres"
        )

    def run(self, *argv: str | os.PathLike[str], timeout: float = 120) -> str:
        """Run a PostgreSQL program as the cluster's owner; its stdout (raises with its output on failure)."""
        result = subprocess.run(
            [str(a) for a in argv], user=self.user, capture_output=True, text=True, timeout=timeout,
            cwd=self.root, check=False,
        )  # fmt: skip
        if result.returncode != 0:
            log = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
            raise RuntimeError(
                f"{argv[0]} failed ({result.returncode}): {result.stderr}{result.stdout}\n{log}"
            )
        return result.stdout

    def start(self, after_initdb: Callable[[LogicalCluster], None] | None = None) -> None:
        """initdb, then ``after_initdb(self)`` (pg_resetwal …) when given, then start the server."""
        binaries = bin_dir()
        self.run(binaries / "initdb", "-D", self.datadir, "-U", "postgres", "--auth=trust", "-E", "UTF8",
                 "--no-sync", "--locale=C")  # fmt: skip
        if after_initdb is not None:
            after_initdb(self)
        settings = {**SETTINGS, "port": str(self.port), "unix_socket_directories": str(self.root)}
        known = self.run(binaries / "postgres", "--describe-config")
        if any(line.startswith("output_plugin_libraries\t") for line in known.splitlines()):
            # Newer minor releases let non-superusers use only the listed output plugins (and superusers
            # too, it turns out): wal2json is not in the default list.
            settings["output_plugin_libraries"] = "pgoutput,test_decoding,wal2json"
        options = " ".join(f"-c {k}={v}" for k, v in settings.items())
        self.run(binaries / "pg_ctl", "-D", self.datadir, "-l", self.log, "-o", options, "-w", "-t", "60",
                 "start")  # fmt: skip

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.run(bin_dir() / "pg_ctl", "-D", self.datadir, "-m", "fast", "-w", "-t", "60", "stop")

    def program(self, name: str) -> Path:
        """Another program of the same PostgreSQL (``pg_recvlogical`` …)."""
        return bin_dir() / name

    def command(self, name: str, *args: str) -> Sequence[str]:
        return [str(self.program(name)), *args]


@contextlib.contextmanager
def logical_cluster(after_initdb: Callable[[LogicalCluster], None] | None = None) -> Iterator[LogicalCluster]:
    """Start a throwaway cluster with ``wal_level=logical``; stop it and delete its directory afterwards.
    ``after_initdb``: run on the new data directory before the server starts."""
    user = _owner()
    root = Path(tempfile.mkdtemp(prefix="sa_outbox_logical_"))
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    cluster = LogicalCluster(root, free_port(), user)
    try:
        cluster.start(after_initdb)
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


# --- decoding: the change stream as PostgreSQL's output plugins give it -----------------------------------


def lsn(text_: str) -> int:
    """``'0/1539278'`` → an integer that orders like the WAL position."""
    hi, _, lo = text_.partition("/")
    return (int(hi, 16) << 32) | int(lo, 16)


@dataclass(frozen=True)
class Change:
    """One decoded row change: ``action`` ``I`` (insert) or ``D`` (delete), the LSN of its WAL record (where it
    was written), and its column values as text (NULL as ``None``; a delete carries the key only)."""

    action: str
    xid: int
    lsn: int
    table: str
    values: dict[str, str | None]


@dataclass
class Transaction:
    """The changes of one committed transaction, as the stream delivers them, and its commit LSN."""

    xid: int
    commit_lsn: int
    changes: list[Change]


WAL2JSON_OPTIONS = ("format-version", "2", "include-xids", "1", "include-lsn", "1")


def parse_wal2json(rows: Sequence[tuple[str, str]]) -> list[Transaction]:
    """``(lsn, data)`` rows of a wal2json (format 2) slot → transactions in stream order (empty ones dropped)."""
    import json

    out: list[Transaction] = []
    current: Transaction | None = None
    for _lsn, data in rows:
        msg = json.loads(data)
        action = msg["action"]
        if action == "B":
            current = Transaction(int(msg["xid"]), lsn(msg["lsn"]), [])
        elif action == "C":
            assert current is not None and lsn(msg["lsn"]) == current.commit_lsn
            if current.changes:
                out.append(current)
            current = None
        elif action in ("I", "U", "D"):
            assert current is not None and int(msg["xid"]) == current.xid, "a change outside its transaction"
            cols = msg.get("columns") if action != "D" else msg.get("identity")
            values = {c["name"]: c["value"] if c["value"] is None else str(c["value"]) for c in cols or []}
            current.changes.append(
                Change(action, current.xid, lsn(msg["lsn"]), f"{msg['schema']}.{msg['table']}", values)
            )
    return out


def parse_pgoutput(rows: Sequence[tuple[str, bytes]]) -> list[Transaction]:
    """``(lsn, data)`` rows of a pgoutput slot (protocol 1, binary) → transactions in stream order.

    The messages used: ``B`` (begin: final LSN, timestamp, xid), ``R`` (relation: id, namespace, name, replica
    identity, columns), ``I``/``U``/``D`` (a tuple: per column ``n`` NULL, ``u`` unchanged TOAST, ``t`` text),
    ``C`` (commit: flags, commit LSN, end LSN, timestamp). PostgreSQL's "Logical Replication Message Formats".
    """
    import struct

    out: list[Transaction] = []
    relations: dict[int, tuple[str, list[str]]] = {}
    current: Transaction | None = None

    def cstring(buf: bytes, at: int) -> tuple[str, int]:
        end = buf.index(b"\x00", at)
        return buf[at:end].decode(), end + 1

    def tuple_data(buf: bytes, at: int, names: list[str]) -> tuple[dict[str, str | None], int]:
        (n,) = struct.unpack_from(">h", buf, at)
        at += 2
        values: dict[str, str | None] = {}
        for i in range(n):
            kind = buf[at : at + 1]
            at += 1
            if kind == b"t":
                (size,) = struct.unpack_from(">i", buf, at)
                values[names[i]] = buf[at + 4 : at + 4 + size].decode()
                at += 4 + size
            elif kind == b"n":
                values[names[i]] = None
            else:  # b"u": an unchanged TOASTed value (updates only)
                values[names[i]] = "<unchanged>"
        return values, at

    for row_lsn, data in rows:
        buf = bytes(data)
        kind = buf[:1]
        if kind == b"B":
            final_lsn, _ts, xid = struct.unpack_from(">qqi", buf, 1)
            current = Transaction(xid, final_lsn, [])
        elif kind == b"R":
            (relid,) = struct.unpack_from(">I", buf, 1)
            namespace, at = cstring(buf, 5)
            name, at = cstring(buf, at)
            at += 1  # replica identity setting
            (ncols,) = struct.unpack_from(">h", buf, at)
            at += 2
            names = []
            for _ in range(ncols):
                at += 1  # flags (1 = part of the key)
                col, at = cstring(buf, at)
                names.append(col)
                at += 8  # type oid, type modifier
            relations[relid] = (f"{namespace}.{name}", names)
        elif kind in (b"I", b"U", b"D"):
            assert current is not None
            (relid,) = struct.unpack_from(">I", buf, 1)
            table, names = relations[relid]
            at = 5
            if kind in (b"U", b"D") and buf[at : at + 1] in (b"K", b"O"):
                old, at = tuple_data(buf, at + 1, names)
                if kind == b"D":
                    values = {k: v for k, v in old.items() if v is not None}
            if kind in (b"I", b"U"):
                at += 1  # b"N": the new tuple
                values, at = tuple_data(buf, at, names)
            current.changes.append(Change(kind.decode(), current.xid, lsn(row_lsn), table, values))
        elif kind == b"C":
            assert current is not None
            _flags, commit_lsn = struct.unpack_from(">bq", buf, 1)
            assert commit_lsn == current.commit_lsn
            if current.changes:
                out.append(current)
            current = None
    return out


# The slot functions, with the slot name, plugin and options as bound parameters.
_CREATE = text("SELECT lsn FROM pg_create_logical_replication_slot(:slot, :plugin)")
_DROP = text("SELECT pg_drop_replication_slot(:slot)")
_TEXT_CHANGES = text(
    "SELECT lsn::text, data FROM pg_logical_slot_get_changes(:slot, NULL, NULL, VARIADIC CAST(:options AS text[]))"
)
_BINARY_CHANGES = text(
    "SELECT lsn::text, data FROM pg_logical_slot_get_binary_changes(:slot, NULL, NULL, "
    "VARIADIC CAST(:options AS text[]))"
)


@dataclass
class Slot:
    """A logical replication slot on ``engine``'s database: ``plugin`` ``wal2json`` (JSON, format 2) or
    ``pgoutput`` (binary protocol 1; ``options`` name the publication). :meth:`take` consumes what it decoded."""

    engine: Engine
    name: str
    plugin: str = "wal2json"
    options: tuple[str, ...] = WAL2JSON_OPTIONS

    def create(self) -> Slot:
        with self.engine.connect() as conn:  # its own transaction: a slot cannot be made after writes
            conn.execute(_CREATE, {"slot": self.name, "plugin": self.plugin})
            conn.commit()
        return self

    def drop(self) -> None:
        with self.engine.connect() as conn:
            conn.execute(_DROP, {"slot": self.name})
            conn.commit()

    def fetch(self) -> list[tuple[str, Any]]:
        """Consume what the slot decoded: its ``(lsn, data)`` rows as the plugin wrote them."""
        binary = self.plugin == "pgoutput"
        with self.engine.connect() as conn:
            rows = conn.execute(_BINARY_CHANGES if binary else _TEXT_CHANGES,
                                {"slot": self.name, "options": list(self.options)}).all()  # fmt: skip
            conn.commit()
        return [(r[0], r[1]) for r in rows]

    def take(self) -> list[Transaction]:
        """Consume what the slot decoded, as transactions in stream order."""
        rows = self.fetch()
        return parse_pgoutput(rows) if self.plugin == "pgoutput" else parse_wal2json(rows)

    def __enter__(self) -> Slot:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.drop()
