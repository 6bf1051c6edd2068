"""Migrations: the project's round trip, empty autogenerate, and a user's own alembic project."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, inspect, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from sa_outbox.errors import ConfigurationError
from sa_outbox.migration import run_migrations_with_lock_retries
from sa_outbox.models import Base

from .conftest import ROOT, alembic_config, migrate, scratch_database


@pytest.fixture
def scratch_url(server_url: URL) -> Iterator[URL]:
    with scratch_database(server_url, "sa_outbox_mig") as url:
        yield url


def _tables(url: URL) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade_round_trip(scratch_url: URL) -> None:
    migrate(scratch_url, "head")
    assert _tables(scratch_url) == {"outbox", "jobs", "jobs_queues", "jobs_starts", "inbox", "schedules"}
    migrate(scratch_url, "base", down=True)
    assert _tables(scratch_url) == set()
    migrate(scratch_url, "head")
    assert _tables(scratch_url) == {"outbox", "jobs", "jobs_queues", "jobs_starts", "inbox", "schedules"}


def _autogenerate_diff(url: URL) -> list[Any]:
    """What autogenerate would write for the reference models against the database at ``url``."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return list(compare_metadata(MigrationContext.configure(conn), Base.metadata))
    finally:
        engine.dispose()


def test_autogenerate_against_reference_models_is_empty(scratch_url: URL) -> None:
    migrate(scratch_url, "head")
    diff = _autogenerate_diff(scratch_url)
    assert diff == []


def test_users_own_alembic_project_autogenerates_the_full_tables(scratch_url: URL, tmp_path: Path) -> None:
    """A throwaway alembic project whose models use the mixins (other table names, a naming convention)."""
    (tmp_path / "mymodels.py").write_text(
        textwrap.dedent(
            """
            from sqlalchemy import MetaData
            from sqlalchemy.orm import DeclarativeBase
            from sa_outbox import JobMixin, OutboxMixin, ScheduleMixin

            class Base(DeclarativeBase):
                metadata = MetaData(naming_convention={
                    "ix": "ix_%(column_0_label)s", "ck": "ck_%(table_name)s_%(constraint_name)s",
                    "pk": "pk_%(table_name)s"})

            class Event(OutboxMixin, Base):
                __tablename__ = "billing_outbox"

            class Task(JobMixin, Base):
                __tablename__ = "billing_jobs"

            class Event2(OutboxMixin, Base):
                __tablename__ = "shipping_outbox"

            class Cron(ScheduleMixin, Base):
                __tablename__ = "billing_schedules"
            """
        )
    )
    url = scratch_url.render_as_string(hide_password=False)
    subprocess.run(
        [sys.executable, "-m", "alembic", "init", "migrations"], cwd=tmp_path, check=True, capture_output=True
    )
    env = (tmp_path / "migrations" / "env.py").read_text()
    env = env.replace("target_metadata = None", "from mymodels import Base\ntarget_metadata = Base.metadata")
    (tmp_path / "migrations" / "env.py").write_text(env)
    ini = (
        (tmp_path / "alembic.ini")
        .read_text()
        .replace("driver://user:pass@localhost/dbname", url.replace("%", "%%"))
    )
    (tmp_path / "alembic.ini").write_text(ini)
    run_env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    gen = subprocess.run(
        [sys.executable, "-m", "alembic", "revision", "--autogenerate", "-m", "init"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=run_env,
    )
    assert gen.returncode == 0, gen.stderr
    up = subprocess.run(
        [sys.executable, "-m", "alembic", "upgrade", "head"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=run_env,
    )
    assert up.returncode == 0, up.stderr
    engine = create_engine(scratch_url)
    try:
        insp = inspect(engine)
        assert {"billing_outbox", "billing_jobs", "shipping_outbox", "billing_schedules"} <= set(
            insp.get_table_names()
        )
        names = {i["name"] for t in ("billing_outbox", "shipping_outbox") for i in insp.get_indexes(t)}
        # Index names carry the table name, so two outbox tables do not collide.
        assert {"ix_billing_outbox_ready", "ix_shipping_outbox_ready", "ix_billing_outbox_aggregate"} <= names
        job_idx = {i["name"]: i for i in insp.get_indexes("billing_jobs")}
        assert (
            job_idx["ix_billing_jobs_dequeue"]["dialect_options"]["postgresql_where"]
            == "(status = 'queued'::text)"
        )
        checks = {c["name"] for c in insp.get_check_constraints("billing_jobs")}
        assert "ck_billing_jobs_status" in checks
        # the unique key's two partial indexes, and the schedules table's own
        assert job_idx["ux_billing_jobs_unique"]["unique"]
        assert job_idx["ux_billing_jobs_unique"]["dialect_options"]["postgresql_where"] == (
            "((status = 'queued'::text) AND (lease_version = 0) AND (unique_key IS NOT NULL))"
        )
        assert job_idx["ix_billing_jobs_unique_active"]["column_names"] == ["unique_key", "status", "id"]
        schedule_idx = {i["name"]: i for i in insp.get_indexes("billing_schedules")}
        assert (
            schedule_idx["ix_billing_schedules_due"]["dialect_options"]["postgresql_where"] == "(NOT paused)"
        )
        assert "ck_billing_schedules_catch_up" in {
            c["name"] for c in insp.get_check_constraints("billing_schedules")
        }
        for table in ("billing_outbox", "billing_jobs", "shipping_outbox"):  # the headers column too
            headers = {c["name"]: c for c in insp.get_columns(table)}["headers"]
            assert headers["nullable"] and type(headers["type"]).__name__ == "JSONB"
    finally:
        engine.dispose()
    check = subprocess.run(
        [sys.executable, "-m", "alembic", "check"], cwd=tmp_path, capture_output=True, text=True, env=run_env
    )
    assert check.returncode == 0, check.stdout + check.stderr


def _columns(url: URL, table: str) -> dict[str, Any]:
    engine = create_engine(url)
    try:
        return {c["name"]: c for c in inspect(engine).get_columns(table)}
    finally:
        engine.dispose()


def test_headers_revision_adds_a_nullable_jsonb_column_to_existing_rows_and_drops_it(
    scratch_url: URL,
) -> None:
    migrate(scratch_url, "0002")
    assert "headers" not in _columns(scratch_url, "outbox") and "headers" not in _columns(scratch_url, "jobs")
    engine = create_engine(scratch_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                              "VALUES ('o', '1', 'E', '{}')"))  # fmt: skip
            conn.execute(text("INSERT INTO jobs (task, payload) VALUES ('t', '{}')"))
        migrate(scratch_url, "0003")
        for table in ("outbox", "jobs"):
            col = _columns(scratch_url, table)["headers"]
            assert col["nullable"] and col["type"].__class__.__name__ == "JSONB"
            with engine.connect() as conn:
                assert conn.execute(text(f"SELECT headers FROM {table}")).scalars().all() == [None]
        migrate(scratch_url, "0002", down=True)
        assert "headers" not in _columns(scratch_url, "outbox") and "headers" not in _columns(
            scratch_url, "jobs"
        )
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM outbox")).scalar_one() == 1
    finally:
        engine.dispose()


def test_an_older_database_is_told_apart_by_autogenerate(scratch_url: URL) -> None:
    """A database migrated before the headers column, the jobs-control, unique/schedules and limits revisions:
    autogenerate proposes exactly the new columns, indexes and tables (a CHECK's or a partial index's new text
    it cannot see: the revisions carry those)."""
    migrate(scratch_url, "0002")
    diff = _autogenerate_diff(scratch_url)
    added = sorted((d[2], d[3].name) for d in diff if d[0] == "add_column")
    tables = sorted(d[1].name for d in diff if d[0] == "add_table")
    indexes = sorted(d[1].name for d in diff if d[0] == "add_index")
    assert added == [
        ("jobs", "cancel_requested_at"),
        ("jobs", "concurrency_key"),
        ("jobs", "headers"),
        ("jobs", "result"),
        ("jobs", "unique_key"),
        ("outbox", "headers"),
    ]
    assert tables == ["jobs_queues", "jobs_starts", "schedules"]
    assert indexes == [
        "ix_jobs_running", "ix_jobs_starts_window", "ix_jobs_unique_active", "ix_outbox_dead", "ix_schedules_due",
        "ux_jobs_unique",
    ]  # fmt: skip
    # 0008 gave the running jobs' index its columns (queue, concurrency_key, locked_at): replaced by name
    assert sorted(d[1].name for d in diff if d[0] == "remove_index") == ["ix_jobs_running"]
    assert len(diff) == 16, diff


def test_unique_and_schedules_revision_keeps_existing_jobs_and_goes_back(scratch_url: URL) -> None:
    """0005 on a jobs table with rows: they hold no key (NULL), the two partial indexes and the schedules table
    appear; the downgrade removes exactly those and keeps the rows."""
    migrate(scratch_url, "0004")
    engine = create_engine(scratch_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO jobs (task, payload) VALUES ('t', '{}'), ('t', '{}')"))
        migrate(scratch_url, "0005")
        assert _columns(scratch_url, "jobs")["unique_key"]["nullable"]
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM jobs WHERE unique_key IS NULL")).scalar_one() == 2
            names = set(
                conn.execute(text("SELECT indexname FROM pg_indexes WHERE tablename = 'jobs'")).scalars()
            )
        assert {"ux_jobs_unique", "ix_jobs_unique_active"} <= names
        assert "schedules" in _tables(scratch_url)
        migrate(scratch_url, "0004", down=True)
        assert "unique_key" not in _columns(scratch_url, "jobs") and "schedules" not in _tables(scratch_url)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM jobs")).scalar_one() == 2
    finally:
        engine.dispose()


def _failed_concurrent_build(conn: Any, name: str, on: str) -> None:
    """What a failed or cancelled ``CREATE INDEX CONCURRENTLY name ON on`` leaves: the index, marked not valid."""
    conn.execute(text(f"CREATE INDEX {name} ON {on}"))
    conn.execute(text(f"UPDATE pg_index SET indisvalid = false WHERE indexrelid = '{name}'::regclass"))


def _indexes(engine: Engine, table: str, names: tuple[str, ...]) -> list[Any]:
    """(name, valid, definition) of the indexes of ``table`` among ``names``."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT c.relname, i.indisvalid, pg_get_indexdef(i.indexrelid) FROM pg_index i "
                    "JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = CAST(:t AS regclass) "
                    "AND c.relname = ANY(:names)"
                ),
                {"t": table, "names": list(names)},
            )
        )


def test_one_running_index_revision_rebuilds_a_failed_concurrent_build_instead_of_renaming_it(
    scratch_url: URL,
) -> None:
    """0008 after an operator's ``CREATE INDEX CONCURRENTLY … ix_jobs_running_0008`` that failed (an INVALID
    index of that name is left behind): the revision builds it again, so the table never ends with the old
    indexes dropped and an unusable one in their place."""
    migrate(scratch_url, "0007")
    engine = create_engine(scratch_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(
                text(
                    "INSERT INTO jobs (task, payload, status, locked_at) VALUES ('t', '{}', 'running', now())"
                )
            )
            _failed_concurrent_build(conn, "ix_jobs_running_0008", "jobs (queue) WHERE status = 'running'")
        migrate(scratch_url, "head")
        found = _indexes(engine, "jobs", ("ix_jobs_running", "ix_jobs_limited", "ix_jobs_running_0008"))
        assert [(name, valid) for name, valid, _ in found] == [("ix_jobs_running", True)]
        assert found[0][2].endswith("(queue, concurrency_key, locked_at) WHERE (status = 'running'::text)")
    finally:
        engine.dispose()


def test_dead_index_revision_rebuilds_a_failed_concurrent_build(scratch_url: URL) -> None:
    """0007 after an operator's ``CREATE INDEX CONCURRENTLY … ix_outbox_dead`` that failed: IF NOT EXISTS alone
    kept the INVALID index at head (a review); the revision builds it again."""
    migrate(scratch_url, "0006")
    engine = create_engine(scratch_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            _failed_concurrent_build(conn, "ix_outbox_dead", "outbox (id) WHERE status = 'dead'")
        migrate(scratch_url, "head")
        assert [(name, valid) for name, valid, _ in _indexes(engine, "outbox", ("ix_outbox_dead",))] == [
            ("ix_outbox_dead", True)
        ]
    finally:
        engine.dispose()


def test_unique_revision_takes_a_column_and_indexes_built_beforehand(scratch_url: URL) -> None:
    """0005's advice for a big jobs table: add the column, build both indexes concurrently, then run the
    revision — which finds them and builds nothing (its advice before could not be followed: the index build
    named a column the revision itself adds)."""
    migrate(scratch_url, "0004")
    engine = create_engine(scratch_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text("ALTER TABLE jobs ADD COLUMN unique_key text"))
            conn.execute(text("CREATE UNIQUE INDEX CONCURRENTLY ux_jobs_unique ON jobs (unique_key) "
                              "WHERE status = 'queued' AND lease_version = 0 AND unique_key IS NOT NULL"))  # fmt: skip
            conn.execute(text("CREATE INDEX CONCURRENTLY ix_jobs_unique_active ON jobs (unique_key, status, id) "
                              "WHERE status IN ('queued', 'running') AND unique_key IS NOT NULL"))  # fmt: skip
        migrate(scratch_url, "head")
        assert "unique_key" in _columns(scratch_url, "jobs") and "schedules" in _tables(scratch_url)
    finally:
        engine.dispose()


def _head(url: URL) -> str:
    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    assert head is not None
    return head


def _traffic(
    url: URL, first: str, second: str, stop: threading.Event, done: list[int], errors: list[str]
) -> None:
    """A service's transactions while the upgrade runs: a row in ``first``, a moment, a row in ``second``."""
    rows = {
        "outbox": "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('o', '1', 'E', '{}')",
        "jobs": "INSERT INTO jobs (task, payload) VALUES ('t', '{}')",
    }
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            while not stop.is_set():
                try:
                    with conn.begin():
                        conn.execute(text(rows[first]))
                        conn.execute(text("SELECT pg_sleep(0.005)"))
                        conn.execute(text(rows[second]))
                    done.append(1)
                except DBAPIError as exc:  # recorded, and the test fails on it
                    errors.append(f"{first}->{second}: {exc.orig!r}")
    finally:
        engine.dispose()


def test_upgrade_under_live_traffic_takes_its_locks_without_deadlocking_the_service(scratch_url: URL) -> None:
    """``alembic upgrade head`` from 0002 while four connections write events and jobs in both orders (a
    review: one transaction for every revision held ``outbox`` from 0003 while it waited for ``jobs``, which a
    service's transaction held while it waited for ``outbox`` — a deadlock, the upgrade or the service's
    transaction rolled back). Each revision is its own transaction now, its lock waits bounded by
    ``lock_timeout`` and retried: the upgrade reaches head and every service transaction commits."""
    migrate(scratch_url, "0002")
    stop = threading.Event()
    done: list[int] = []
    errors: list[str] = []
    threads = [
        threading.Thread(target=_traffic, args=(scratch_url, first, second, stop, done, errors))
        for first, second in (("jobs", "outbox"), ("outbox", "jobs")) * 2
    ]
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.3)
        env = {**os.environ, "DATABASE_URL": scratch_url.render_as_string(hide_password=False)}
        up = subprocess.run(
            [sys.executable, "-m", "alembic", "upgrade", "head"],
            cwd=ROOT, capture_output=True, text=True, env=env, timeout=240,
        )  # fmt: skip
        time.sleep(0.3)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert up.returncode == 0, up.stderr[-3000:]
    assert errors == []
    engine = create_engine(scratch_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == _head(
                scratch_url
            )
            written = conn.execute(
                text("SELECT (SELECT count(*) FROM outbox), (SELECT count(*) FROM jobs)")
            ).one()
    finally:
        engine.dispose()
    assert len(done) > 0 and tuple(written) == (len(done), len(done))


def test_upgrade_behind_a_long_transaction_gives_up_at_a_revision_boundary_and_resumes(
    scratch_url: URL,
) -> None:
    """A transaction that holds ``jobs`` for the whole upgrade: every try of 0003's ``jobs`` step waits
    ``lock_timeout`` and is rolled back; after ``give_up_after`` the upgrade stops with a message naming the
    revision reached, the service's transaction untouched. Run again once it ended, it goes on to head."""
    migrate(scratch_url, "0002")
    env = {**os.environ, "DATABASE_URL": scratch_url.render_as_string(hide_password=False)}
    upgrade = [
        sys.executable,
        "-m",
        "alembic",
        "-x",
        "lock_timeout=0.2",
        "-x",
        "give_up_after=1.5",
        "upgrade",
        "head",
    ]
    engine = create_engine(scratch_url, poolclass=NullPool)
    try:
        with engine.connect() as holder:
            holder.execute(text("INSERT INTO jobs (task, payload) VALUES ('long', '{}')"))
            stuck = subprocess.run(upgrade, cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
            assert holder.execute(text("SELECT count(*) FROM jobs")).scalar_one() == 1  # still usable
            holder.commit()
        assert stuck.returncode != 0
        assert "migration stopped at revision 0002" in stuck.stderr, stuck.stderr[-2000:]
        assert "could not take its locks" in stuck.stderr and "lock timeout" in stuck.stderr
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == "0002"
        again = subprocess.run(upgrade, cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
        assert again.returncode == 0, again.stderr[-2000:]
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == _head(
                scratch_url
            )
            assert conn.execute(text("SELECT task FROM jobs")).scalars().all() == ["long"]
        assert _autogenerate_diff(scratch_url) == []
    finally:
        engine.dispose()


def test_lock_retries_refuse_a_connection_inside_a_transaction_and_bad_durations(scratch_url: URL) -> None:
    engine = create_engine(scratch_url, poolclass=NullPool)
    try:
        with engine.begin() as conn, pytest.raises(ConfigurationError, match="outside a transaction"):
            run_migrations_with_lock_retries(object(), conn)
        with engine.connect() as conn:
            with pytest.raises(ConfigurationError, match="lock_timeout must be > 0"):
                run_migrations_with_lock_retries(object(), conn, lock_timeout=0)
            with pytest.raises(ConfigurationError, match="give_up_after must be >= 0"):
                run_migrations_with_lock_retries(object(), conn, give_up_after=-1)
    finally:
        engine.dispose()
    env = {**os.environ, "DATABASE_URL": scratch_url.render_as_string(hide_password=False)}
    bad = subprocess.run(
        [sys.executable, "-m", "alembic", "-x", "lock_timeout=soon", "upgrade", "head"],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert bad.returncode != 0 and "-x lock_timeout=soon: a number of seconds" in bad.stderr
    assert _tables(scratch_url) == set()


def test_a_relative_target_is_not_retried_past_where_it_was_asked_to_stop(scratch_url: URL) -> None:
    """A review: ``downgrade -2`` whose second revision met a lock was re-run as ``-2`` from the revision it had
    reached, and went one revision too far (0006's downgrade dropped concurrency_key and jobs_starts). A
    relative target now stops at the first lock fault and says why; the revisions done stay done."""
    migrate(scratch_url, "0005")
    env = {**os.environ, "DATABASE_URL": scratch_url.render_as_string(hide_password=False)}
    engine = create_engine(scratch_url, poolclass=NullPool)
    try:
        with engine.connect() as holder:
            holder.execute(text("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                                "VALUES ('o', '1', 'E', '{}')"))  # fmt: skip
            up = subprocess.run(
                [sys.executable, "-m", "alembic", "-x", "lock_timeout=0.2", "upgrade", "+2"],
                cwd=ROOT, capture_output=True, text=True, env=env, timeout=120,
            )  # fmt: skip
            holder.commit()
        assert up.returncode != 0
        assert (
            "migration stopped at revision 0006" in up.stderr
            and "relative target (+2) is not retried" in (up.stderr)
        )
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == "0006"
    finally:
        engine.dispose()


class _Context:
    """Stands in for alembic's context: each try reads the session's lock_timeout; the first meets a real lock
    timeout (a table lock another connection holds)."""

    def __init__(self, connection: Any, holder: Any) -> None:
        self.connection, self.holder, self.tries, self.seen = connection, holder, 0, []

    def configure(self, **kw: Any) -> None:
        assert kw["transaction_per_migration"] is True and kw["connection"] is self.connection

    def begin_transaction(self) -> Any:
        return contextlib.nullcontext()

    def get_revision_argument(self) -> str:
        return "head"

    def run_migrations(self) -> None:
        self.tries += 1
        self.seen.append(self.connection.execute(text("SHOW lock_timeout")).scalar_one())
        if self.tries == 1:
            self.connection.execute(text("LOCK TABLE held IN ACCESS EXCLUSIVE MODE"))
        self.connection.commit()  # as alembic commits each revision


def test_lock_retries_set_the_timeout_for_each_try_and_put_the_sessions_back(scratch_url: URL) -> None:
    engine = create_engine(scratch_url)  # pooled: the connection goes back to the pool afterwards
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE held (id int)"))
        with engine.connect() as holder, engine.connect() as conn:
            holder.execute(text("LOCK TABLE held IN SHARE MODE"))
            conn.execute(text("SET lock_timeout = '7s'"))
            conn.commit()
            context = _Context(conn, holder)
            timer = threading.Timer(1.0, holder.commit)
            timer.start()
            try:
                run_migrations_with_lock_retries(context, conn, lock_timeout=0.2)
            finally:
                timer.cancel()
            assert context.tries >= 2 and set(context.seen) == {"200ms"}
            assert conn.execute(text("SHOW lock_timeout")).scalar_one() == "7s"
    finally:
        engine.dispose()
