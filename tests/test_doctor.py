"""doctor reports each unhealthy condition created on purpose, with its fix, and ok once it is removed;
locks shows a blocked UPDATE and its blocker."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import BigInteger, Column, Engine, ForeignKey, MetaData, Text, create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.pool import NullPool

from sa_outbox import JobMixin, OutboxMixin
from sa_outbox._cli import main
from sa_outbox.doctor import Finding, LockInfo, doctor, locks
from sa_outbox.errors import ConfigurationError
from sa_outbox.models import Job, OutboxEvent

from .conftest import migrate, migrated_database, scratch_database
from .helpers import seed_events
from .sessions import open_snapshot


def by_check(findings: list[Finding], check: str, table: str | None = "outbox") -> list[Finding]:
    return [f for f in findings if f.check == check and (table is None or f.table == table)]


def run(engine: Engine, **kw: Any) -> list[Finding]:
    return doctor(engine, [OutboxEvent, Job], **kw)


def server_autovacuum(engine: Engine) -> str:
    with engine.connect() as conn:
        return str(conn.execute(text("SHOW autovacuum")).scalar_one())


def vacuum(engine: Engine) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM outbox, jobs"))


def test_healthy_installation_is_all_ok(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    vacuum(engine)  # other tests of this run left dead tuples behind (and autovacuum may be off)
    findings = run(engine)
    not_ok = [f for f in findings if f.status != "ok"]
    if server_autovacuum(engine) == "off":  # this machine's PostgreSQL: the one thing doctor must report
        assert [(f.check, f.table, f.status) for f in not_ok] == [("autovacuum", None, "warn")], not_ok
    else:
        assert not_ok == []
    code = main(["doctor", "--json", "--url", db_url.render_as_string(hide_password=False)])
    assert code == 0 and json.loads(capsys.readouterr().out)["ok"] is True  # a warning is not a failure


def test_a_missing_unique_index_is_fixed_by_a_concurrent_build(engine: Engine) -> None:
    """A plain CREATE UNIQUE INDEX holds a SHARE lock on jobs for the whole build: every claim and finalize
    would wait. The fix builds it CONCURRENTLY like the others (a review found the plain form)."""
    with engine.begin() as conn:
        conn.execute(text("DROP INDEX ux_jobs_unique"))
    try:
        [missing] = [f for f in by_check(run(engine), "indexes", "jobs") if f.status == "fail"]
        assert "ux_jobs_unique is missing" in missing.message
        assert missing.fix is not None and missing.fix.startswith(
            "CREATE UNIQUE INDEX CONCURRENTLY ux_jobs_unique "
        )
    finally:
        with engine.begin() as conn:
            conn.execute(text(missing.fix.replace(" CONCURRENTLY", "")))


def test_dropped_partial_index_fails_the_plan_and_index_checks(engine: Engine, db_url: URL) -> None:
    seed_events(engine, 5)
    with engine.begin() as conn:
        conn.execute(text("DROP INDEX ix_outbox_ready"))
        conn.execute(text("ANALYZE outbox"))
    try:
        findings = run(engine)
        [plan] = by_check(findings, "claim plan")
        assert plan.status == "fail" and "ix_outbox_ready" in plan.message
        missing = [f for f in by_check(findings, "indexes") if f.status == "fail"]
        assert len(missing) == 1 and "ix_outbox_ready is missing" in missing[0].message
        assert (
            missing[0].fix is not None
            and "CREATE INDEX CONCURRENTLY ix_outbox_ready ON outbox (available_at, id)" in missing[0].fix
        )
        assert main(["doctor", "--url", db_url.render_as_string(hide_password=False)]) == 1
    finally:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "CREATE INDEX IF NOT EXISTS ix_outbox_ready ON outbox (available_at, id) WHERE status = 'pending'"
                )
            )
    assert by_check(run(engine), "claim plan")[0].status == "ok"


def test_long_repeatable_read_transaction_is_named_with_a_fix(engine: Engine) -> None:
    with engine.connect() as holder:
        pid = open_snapshot(holder, "nightly-report", "SELECT count(*) FROM jobs")
        time.sleep(0.15)
        [finding] = by_check(run(engine, long_transaction=0.1), "xmin horizon", None)
        holder.rollback()
    assert finding.status == "warn" and f"pid {pid} (nightly-report" in finding.message
    assert finding.fix == f"SELECT pg_terminate_backend({pid})"
    assert by_check(run(engine, long_transaction=1.0), "xmin horizon", None)[0].status == "ok"


def test_idle_transaction_holding_a_row_lock_is_reported(engine: Engine) -> None:
    seed_events(engine, 1)
    with engine.connect() as holder:
        holder.begin()
        holder.execute(text("SELECT id FROM outbox WHERE id = 1 FOR UPDATE"))
        pid = holder.execute(text("SELECT pg_backend_pid()")).scalar_one()
        [finding] = by_check(run(engine), "idle in transaction", None)
        holder.rollback()
    assert (
        finding.status == "warn"
        and f"pid {pid}" in finding.message
        and "RowShareLock on table outbox" in finding.message
        and "row locks" in finding.message
    )
    assert by_check(run(engine), "idle in transaction", None)[0].status == "ok"


def test_expired_leases_are_stuck_rows(engine: Engine) -> None:
    seed_events(engine, 2)
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE outbox SET status = 'processing', attempts = 1, lease_version = 1, lease_until = now() - interval '1 minute'"
            )
        )
    [finding] = by_check(run(engine), "stuck rows")
    assert finding.status == "warn" and finding.message.startswith("2 row(s) leased past their lease")
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox SET status = 'done', done_at = now(), lease_until = NULL"))
    assert by_check(run(engine), "stuck rows")[0].status == "ok"


def test_missing_autovacuum_settings_warn_with_the_alter(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE jobs RESET (autovacuum_vacuum_scale_factor)"))
    try:
        [finding] = by_check(run(engine), "autovacuum settings", "jobs")
        assert finding.status == "warn" and "autovacuum_vacuum_scale_factor" in finding.message
        assert finding.fix is not None and finding.fix.startswith(
            "ALTER TABLE jobs SET (autovacuum_vacuum_scale_factor = 0.01"
        )
    finally:
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE jobs SET (autovacuum_vacuum_scale_factor = 0.01)"))
    assert by_check(run(engine), "autovacuum settings", "jobs")[0].status == "ok"


def settled(lk: LockInfo, holder_pid: int) -> bool:
    """The waiter as it stands once queued: blocked by the holder, waiting on a lock, holding the tuple lock."""
    return (
        holder_pid in lk.blocked_by
        and lk.wait_event_type == "Lock"
        and any(h.startswith("ExclusiveLock on row") for h in lk.holds)
    )


@contextmanager
def update_blocked_by_a_row_lock(engine: Engine) -> Iterator[tuple[int, list[LockInfo]]]:
    """A session holding row 1 with FOR UPDATE (idle in transaction) and, in a thread with its own
    connection, an UPDATE of that row waiting for it; yields the holder's pid and ``locks()`` as seen while
    the UPDATE waits (bounded: 10 s)."""
    seed_events(engine, 1)
    with engine.connect() as holder:
        holder.begin()
        holder.execute(text("SELECT id FROM outbox WHERE id = 1 FOR UPDATE"))
        holder_pid = int(holder.execute(text("SELECT pg_backend_pid()")).scalar_one())

        def blocked_update() -> None:
            with engine.connect() as other:
                other.execute(text("SET LOCAL lock_timeout = '10s'"))
                other.execute(text("UPDATE outbox SET attempts = attempts + 1 WHERE id = 1"))
                other.commit()

        thread = threading.Thread(target=blocked_update)
        thread.start()
        try:
            deadline = time.monotonic() + 10
            seen: list[LockInfo] = []
            # pg_stat_activity is snapshotted once per query while pg_locks and pg_blocking_pids are read
            # live, so one read can catch the waiter between its SET and its UPDATE, or before it queued for
            # the tuple lock: poll until one read shows the whole picture (all three views agree)
            while time.monotonic() < deadline and not any(settled(lk, holder_pid) for lk in seen):
                seen = locks(engine, ["outbox", "jobs"])
                time.sleep(0.05)
            yield holder_pid, seen
        finally:
            holder.rollback()
            thread.join(10)


def test_locks_shows_a_blocked_update_and_its_blocker(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    with update_blocked_by_a_row_lock(engine) as (holder_pid, seen):
        assert main(["locks", "--json", "--url", db_url.render_as_string(hide_password=False)]) == 0
        report = json.loads(capsys.readouterr().out)
    waiting = [lk for lk in seen if holder_pid in lk.blocked_by]
    assert (
        waiting and "UPDATE outbox SET attempts" in waiting[0].query and waiting[0].wait_event_type == "Lock"
    )
    blocked = [r for r in report if holder_pid in r["blocked_by"]]
    assert blocked and any(r["pid"] == holder_pid and r["idle_in_transaction"] for r in report)


def test_autovacuum_turned_off_for_a_table_is_a_warning_with_the_reset(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE jobs SET (autovacuum_enabled = false)"))
    try:
        [finding] = by_check(run(engine), "autovacuum", "jobs")
        assert finding.status == "warn" and "autovacuum_enabled = false" in finding.message
        assert finding.fix == "ALTER TABLE jobs RESET (autovacuum_enabled)"
    finally:
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE jobs RESET (autovacuum_enabled)"))
    assert by_check(run(engine), "autovacuum", "jobs") == []  # per table: reported only when off


def test_autovacuum_off_server_wide_is_a_warning_not_ok(engine: Engine) -> None:
    [finding] = by_check(run(engine), "autovacuum", None)
    if server_autovacuum(engine) == "off":  # how this machine's PostgreSQL runs
        assert finding.status == "warn" and "autovacuum = off" in finding.message
        assert finding.fix is not None and finding.fix.splitlines() == [
            "ALTER SYSTEM SET autovacuum = on",
            "SELECT pg_reload_conf()",
        ]
    else:
        assert finding.status == "ok" and "autovacuum = on" in finding.message


def test_dead_tuple_fix_names_the_causes_that_are_really_there(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                "SELECT 'o', g::text, 'E', '{}' FROM generate_series(1, 12000) g"
            )
        )
        conn.execute(text("ALTER TABLE outbox SET (autovacuum_enabled = false)"))
    try:
        with engine.begin() as conn:
            conn.execute(text("UPDATE outbox SET attempts = 1"))  # 12,000 dead tuples, half the table
            conn.execute(text("SELECT pg_stat_force_next_flush()"))  # counted in the statistics at commit
        [finding] = by_check(run(engine), "dead tuples")
        assert finding.status == "warn" and finding.fix is not None
        assert "VACUUM (ANALYZE) outbox" in finding.fix
        assert "autovacuum_enabled = false" in finding.fix  # the real cause ...
        assert "settings are present" not in finding.fix  # ... not advice about settings that are there
        assert "xmin horizon" not in finding.fix  # nothing holds it
    finally:
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE outbox RESET (autovacuum_enabled)"))
    vacuum(engine)
    assert by_check(run(engine), "dead tuples")[0].status == "ok"


def test_invalid_index_fix_is_one_statement_per_line_each_runs_in_psql(engine: Engine, db_url: URL) -> None:
    seed_events(engine, 2, aggregate="same")
    psql_url = db_url.set(drivername="postgresql").render_as_string(hide_password=False)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("DROP INDEX ix_outbox_ready"))
        with pytest.raises(Exception, match="could not create unique index"):  # a failed build: INVALID left
            conn.execute(
                text(
                    "CREATE UNIQUE INDEX CONCURRENTLY ix_outbox_ready ON outbox (aggregate_type) "
                    "WHERE status = 'pending'"
                )
            )
    try:
        [invalid] = [f for f in by_check(run(engine), "indexes") if f.status == "fail"]
        assert "ix_outbox_ready is INVALID" in invalid.message and invalid.fix is not None
        lines = invalid.fix.splitlines()
        assert lines[0] == "DROP INDEX CONCURRENTLY ix_outbox_ready"
        assert lines[1].startswith("CREATE INDEX CONCURRENTLY ix_outbox_ready ON outbox (available_at, id)")
        for line in lines:  # what an operator pastes: one psql -c per line
            done = subprocess.run(["psql", psql_url, "-v", "ON_ERROR_STOP=1", "-c", line],
                                  capture_output=True, text=True, timeout=60)  # fmt: skip
            assert done.returncode == 0, done.stderr
        assert by_check(run(engine), "indexes")[0].status == "ok"
    finally:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            valid = conn.execute(
                text("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass('ix_outbox_ready')")
            ).scalar()
            if not valid:
                conn.execute(text("DROP INDEX IF EXISTS ix_outbox_ready"))
                conn.execute(
                    text("CREATE INDEX ix_outbox_ready ON outbox (available_at, id) WHERE status = 'pending'")
                )


def test_idle_session_holding_only_access_share_is_not_said_to_block_claims(engine: Engine) -> None:
    seed_events(engine, 1)
    with engine.connect() as holder:
        holder.begin()
        holder.execute(text("SELECT count(*) FROM outbox"))  # AccessShareLock only: claims are not blocked
        pid = holder.execute(text("SELECT pg_backend_pid()")).scalar_one()
        [finding] = by_check(run(engine), "idle in transaction", None)
        holder.rollback()
    assert finding.status == "warn" and f"pid {pid}" in finding.message
    assert "AccessShareLock on table outbox" in finding.message
    assert "block claims" not in finding.message and "row lock" not in finding.message
    assert "ALTER" in finding.message  # what it does block: DDL that needs an exclusive lock


def test_locks_labels_a_tuple_lock_as_a_row_not_a_table(engine: Engine) -> None:
    with update_blocked_by_a_row_lock(engine) as (holder_pid, seen):
        pass
    waiter = [lk for lk in seen if holder_pid in lk.blocked_by]
    assert waiter, "the UPDATE never showed up as blocked"
    holds = waiter[0].holds
    assert "RowExclusiveLock on table outbox" in holds
    assert any(h.startswith("ExclusiveLock on row (0,1) of outbox") for h in holds), holds
    assert "ExclusiveLock on outbox" not in holds


def test_stuck_jobs_are_counted_with_the_workers_stale_after(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO jobs (task, queue, payload, status, attempts, lease_version, locked_by, locked_at) "
                "VALUES ('long', 'default', '{}', 'running', 1, 1, 'w', now() - interval '2 minutes')"
            )
        )
    assert by_check(run(engine), "stuck rows", "jobs")[0].status == "warn"  # with the 60 s default
    assert by_check(run(engine, stale_after=600), "stuck rows", "jobs")[0].status == "ok"


def test_the_library_defaults_pass_the_lease_check_and_a_publish_timeout_eating_the_lease_warns(
    engine: Engine,
) -> None:
    from sa_outbox import Dispatcher
    from sa_outbox.testing import RecordingPublisher

    defaults = Dispatcher(engine, OutboxEvent, RecordingPublisher(), listen=False)
    tight = Dispatcher(engine, OutboxEvent, RecordingPublisher(), listen=False, lease=20, publish_timeout=15)
    try:
        [ok] = by_check(run(engine, target=defaults), "lease vs publish timeout", None)
        [warn] = by_check(run(engine, target=tight), "lease vs publish timeout", None)
    finally:
        defaults.close()
        tight.close()
    assert ok.status == "ok", ok
    assert warn.status == "warn" and "publish_timeout 15s" in warn.message and warn.fix


@pytest.mark.parametrize("bad", [{"dead_ratio_warn": 1.5}, {"dead_ratio_warn": -0.1}, {"stale_after": 0},
                                 {"long_transaction": -1}])  # fmt: skip
def test_doctor_refuses_bad_options(engine: Engine, bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError, match=next(iter(bad))):
        run(engine, **bad)


def test_doctor_names_an_unavailable_destination_with_the_fix(engine: Engine) -> None:
    """Issue #19 §1: rows given back by a dispatcher that could not reach its broker (real rows)."""
    from .test_operations import _refunded_by_an_unreachable_broker

    assert [f.status for f in by_check(run(engine), "destination")] == ["ok"]
    _refunded_by_an_unreachable_broker(engine, 2)
    (finding,) = by_check(run(engine), "destination")
    assert finding.status == "warn"
    assert "the broker is down or unreachable since at least" in finding.message
    assert "the dispatcher is probing it" in finding.message and "DestinationUnavailable" in finding.message
    assert (
        finding.fix is not None
        and "bring the broker back" in finding.fix
        and "no attempt is spent" in finding.fix
    )


def test_doctor_states_how_long_a_failing_row_is_retried_and_warns_when_a_blip_would_kill_it(
    engine: Engine,
) -> None:
    from sa_outbox import Backoff, Worker
    from sa_outbox.doctor import doctor
    from sa_outbox.models import Job, OutboxEvent

    budget = {f.table: f for f in doctor(engine, [OutboxEvent, Job]) if f.check == "retry budget"}
    assert budget["outbox"].status == "ok" and "at most 23.5 min" in budget["outbox"].message
    assert "spends no attempt" in budget["outbox"].message
    assert budget["jobs"].status == "ok" and "10 attempts" in budget["jobs"].message
    assert "about 13.5 min" in budget["jobs"].message  # 2+4+…+256+300 s
    hasty = Worker(engine, Job, {}, backoff=Backoff(0.1, 1, jitter=False), listen=False)
    (finding,) = [f for f in doctor(engine, [Job], target=hasty) if f.check == "retry budget"]
    assert finding.status == "warn" and "about 7 s" in finding.message and finding.fix


def _non_ok(findings: list[Finding]) -> list[tuple[str, str | None, str, str]]:
    """What doctor says is wrong, without the server-wide autovacuum warning of this machine."""
    return [
        (f.check, f.table, f.status, f.message) for f in findings if f.status != "ok" and f.table is not None
    ]


def test_an_older_schema_is_named_column_by_column_instead_of_raising(server_url: URL) -> None:
    """A database at revision 0002 (before headers, jobs control, unique keys, limits): doctor raised the claim
    EXPLAIN's UndefinedColumn (a review). It now says which columns are missing and how to add them, and skips
    the checks that read them; the CLI exits 1."""
    with migrated_database(server_url, "0002", "sa_outbox_doc") as (url, engine):
        found = _non_ok(run(engine))
        assert [(c, t, s) for c, t, s, _ in found] == [("columns", "outbox", "fail")] + [
            ("columns", "jobs", "fail")
        ] * 2
        assert "column headers missing" in found[0][3]
        assert (
            "columns headers, cancel_requested_at, result, concurrency_key, unique_key missing" in found[1][3]
        )
        # and what 0004 changed in a column 0002 has
        assert "max_attempts: integer NOT NULL DEFAULT 3, expected integer NOT NULL DEFAULT 10" in found[2][3]
        fix = next(f.fix for f in run(engine) if f.check == "columns" and f.table == "jobs")
        assert fix is not None and "ALTER TABLE jobs ADD COLUMN unique_key TEXT" in fix
        assert main(["doctor", "--url", url.render_as_string(hide_password=False)]) == 1


def test_an_index_of_an_older_version_under_the_same_name_is_not_taken_for_the_new_one(
    server_url: URL,
) -> None:
    """At revision 0006 ``ix_jobs_running`` is the old ``(locked_at)`` index: doctor compared names only and
    said all indexes were present. It compares definitions as PostgreSQL normalised them now."""
    with migrated_database(server_url, "0006", "sa_outbox_doc") as (url, engine):
        found = _non_ok(run(engine))
        assert [(c, t, s) for c, t, s, _ in found] == [
            ("indexes", "outbox", "fail"), ("indexes", "jobs", "fail"), ("indexes", "jobs", "warn")
        ]  # fmt: skip
        # and 0006's second index over running jobs, which 0008 drops, is still written by every claim
        assert found[2][3].startswith(
            "index ix_jobs_limited not in the model: every claim and finalize writes"
        )
        [stale] = [f for f in run(engine) if f.check == "indexes" and f.status == "warn"]
        assert stale.fix == "DROP INDEX CONCURRENTLY ix_jobs_limited"
        assert found[0][3] == "index ix_outbox_dead is missing"
        assert found[1][3].startswith(
            "index ix_jobs_running is btree (locked_at) WHERE (status = 'running'::text), expected btree "
            "(queue, concurrency_key, locked_at) WHERE (status = 'running'::text)"
        )
        [wrong] = [
            f for f in run(engine) if f.check == "indexes" and f.table == "jobs" and f.status == "fail"
        ]
        assert wrong.fix is not None and wrong.fix.splitlines() == [
            "DROP INDEX CONCURRENTLY ix_jobs_running",
            "CREATE INDEX CONCURRENTLY ix_jobs_running ON jobs (queue, concurrency_key, locked_at) "
            "WHERE status = 'running'",
        ]
        migrate(url, "head")
        assert _non_ok(run(engine)) == []


def test_a_check_constraint_or_column_type_that_drifted_is_a_failure(server_url: URL) -> None:
    with migrated_database(server_url, "head", "sa_outbox_doc") as (_url, engine):
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE jobs DROP CONSTRAINT ck_jobs_status"))
            conn.execute(text("ALTER TABLE jobs ADD CONSTRAINT ck_jobs_status "
                              "CHECK (status IN ('queued', 'running', 'done', 'failed'))"))  # fmt: skip
            conn.execute(text("ALTER TABLE outbox ALTER COLUMN attempts TYPE bigint"))
        found = _non_ok(run(engine))
        assert [(c, t) for c, t, _, _ in found] == [("columns", "outbox"), ("constraints", "jobs")]
        assert "attempts: bigint NOT NULL DEFAULT 0, expected integer NOT NULL DEFAULT 0" in found[0][3]
        assert "ck_jobs_status is" in found[1][3] and "'cancelled'::text" in found[1][3]
        [check] = [f for f in run(engine) if f.check == "constraints" and f.table == "jobs"]
        assert check.fix is not None
        with engine.begin() as conn:  # the fix as given repairs it
            for line in check.fix.splitlines()[1:]:
                conn.execute(text(line))
            conn.execute(text("ALTER TABLE outbox ALTER COLUMN attempts TYPE integer"))
        assert _non_ok(run(engine)) == []


def test_long_table_names_whose_index_names_were_shortened_are_found(server_url: URL) -> None:
    """A 50-character jobs table: SQLAlchemy shortens ``ix_<table>_unique_active`` past 63 bytes (a hash
    suffix); doctor looked for the long name and reported it missing (a review)."""

    class LongBase(DeclarativeBase):
        pass

    class LongJob(JobMixin, LongBase):
        __tablename__ = "j" * 45 + "_jobs"

    class LongEvent(OutboxMixin, LongBase):
        __tablename__ = "e" * 49 + "_outbox"

    class AccentJob(JobMixin, LongBase):  # under 63 characters, over 63 bytes: PostgreSQL cuts these by bytes
        __tablename__ = "é" * 25 + "_jobs"

    with scratch_database(server_url, "sa_outbox_doc") as url:
        engine = create_engine(url, poolclass=NullPool)
        try:
            LongBase.metadata.create_all(engine)
            assert _non_ok(doctor(engine, [LongEvent, LongJob, AccentJob])) == []
            with engine.connect() as conn:
                short = conn.execute(
                    text("SELECT indexname FROM pg_indexes WHERE indexname LIKE '%_jobs_u\\_%'")
                ).scalar_one()
            assert re.fullmatch(r"ix_j{45}_jobs_u_[0-9a-f]{4}", short)  # 55 characters, "_", 4 of an md5
            with engine.begin() as conn:
                conn.execute(text(f"DROP INDEX {short}"))
            assert _non_ok(doctor(engine, [LongEvent, LongJob])) == [
                ("indexes", LongJob.__tablename__, "fail", f"index {short} is missing")
            ]
        finally:
            engine.dispose()


def test_without_the_temporary_privilege_doctor_checks_names_and_says_so(server_url: URL) -> None:
    role = f"sa_outbox_doc_{uuid.uuid4().hex[:6]}"
    admin = create_engine(server_url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    try:
        with scratch_database(server_url, "sa_outbox_doc") as url:
            migrate(url, "head")
            owner = create_engine(url, poolclass=NullPool)
            with owner.begin() as conn:
                conn.execute(text(f"CREATE ROLE {role} LOGIN"))
                conn.execute(text(f'REVOKE TEMPORARY ON DATABASE "{url.database}" FROM PUBLIC'))
                conn.execute(text(f"GRANT SELECT, UPDATE ON ALL TABLES IN SCHEMA public TO {role}"))
            owner.dispose()
            reader = create_engine(url.set(username=role, password=None), poolclass=NullPool)
            try:
                found = {(f.check, f.table): f for f in doctor(reader, [OutboxEvent, Job])}
            finally:
                reader.dispose()
            for table in ("outbox", "jobs"):
                assert found["columns", table].status == "ok" and found["indexes", table].status == "ok"
                assert (
                    "(types not compared: InsufficientPrivilege: permission denied"
                    in found["columns", table].message
                )
                assert "(definitions not compared: InsufficientPrivilege" in found["indexes", table].message
                assert ("constraints", table) not in found
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP ROLE IF EXISTS {role}"))
        admin.dispose()


def test_what_makes_every_write_fail_or_differ_is_not_ok(server_url: URL) -> None:
    """A review's tables that doctor passed as ok while every library write failed or differed: the identity
    dropped from ``id`` and the ``status`` default dropped (NotNullViolation on every event and job), the
    pre-0004 ``max_attempts`` default, and a CHECK under another name that refuses ``cancelled``."""
    with migrated_database(server_url, "head", "sa_outbox_doc") as (_url, engine):
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE outbox ALTER COLUMN id DROP IDENTITY"))
            conn.execute(text("ALTER TABLE outbox ALTER COLUMN status DROP DEFAULT"))
            conn.execute(text("ALTER TABLE jobs ALTER COLUMN max_attempts SET DEFAULT 3"))
            conn.execute(text("ALTER TABLE jobs ADD CONSTRAINT no_cancel CHECK (status <> 'cancelled')"))
        found = {(f.check, f.table): f for f in run(engine) if f.status != "ok" and f.table is not None}
        assert sorted(found) == [("columns", "jobs"), ("columns", "outbox"), ("constraints", "jobs")]
        outbox = found["columns", "outbox"].message
        assert "id: bigint NOT NULL, expected bigint NOT NULL GENERATED ALWAYS AS IDENTITY" in outbox
        assert "status: text NOT NULL, expected text NOT NULL DEFAULT 'pending'::text" in outbox
        assert "max_attempts: integer NOT NULL DEFAULT 3, expected integer NOT NULL DEFAULT 10" in (
            found["columns", "jobs"].message
        )
        check = found["constraints", "jobs"]
        assert check.status == "warn" and "no_cancel (CHECK ((status <> 'cancelled'::text)))" in check.message
        assert check.fix == "ALTER TABLE jobs DROP CONSTRAINT no_cancel"


def test_user_models_with_foreign_keys_flag_indexes_and_no_indexes_get_findings_not_exceptions(
    server_url: URL,
) -> None:
    """A review: doctor raised NoReferencedTableError for a model with a foreign key (its temporary copy
    named the referenced table in pg_temp), StopIteration for a model whose ``__table_args__`` left out the
    mixin's indexes, and passed a ``Column(index=True, unique=True)`` index rebuilt without UNIQUE (the
    copy's index got another name from ``ix_%(column_0_label)s``)."""

    class UserBase(DeclarativeBase):
        metadata = MetaData(naming_convention={"ix": "ix_%(column_0_label)s"})

    class Tenant(UserBase):
        __tablename__ = "tenants"
        id: Mapped[int] = mapped_column(BigInteger, primary_key=True)

    class TenantEvent(OutboxMixin, UserBase):
        __tablename__ = "tenant_outbox"
        tenant_id = Column(BigInteger, ForeignKey("tenants.id"), nullable=True)

    class OrderJob(JobMixin, UserBase):
        __tablename__ = "order_jobs"
        order_ref = Column(Text, index=True, unique=True)

    class BareBase(DeclarativeBase):
        pass

    class Bare(OutboxMixin, BareBase):
        __tablename__ = "bare_outbox"
        __table_args__ = ({"comment": "no indexes"},)

    with scratch_database(server_url, "sa_outbox_doc") as url:
        engine = create_engine(url, poolclass=NullPool)
        try:
            UserBase.metadata.create_all(engine)
            BareBase.metadata.create_all(engine)
            assert _non_ok(doctor(engine, [TenantEvent, OrderJob])) == []
            with engine.begin() as conn:
                conn.execute(text("DROP INDEX ix_order_jobs_order_ref"))
                conn.execute(text("CREATE INDEX ix_order_jobs_order_ref ON order_jobs (order_ref)"))
            assert _non_ok(doctor(engine, [TenantEvent, OrderJob])) == [
                ("indexes", "order_jobs", "fail", "index ix_order_jobs_order_ref is btree (order_ref), expected "
                 "UNIQUE btree (order_ref) (an older version's index?)")
            ]  # fmt: skip
            [plan] = [f for f in doctor(engine, [Bare]) if f.check == "claim plan"]
            assert plan.status == "fail" and "ix_bare_outbox_ready" in plan.message
        finally:
            engine.dispose()


def test_a_column_of_another_collation_is_said_and_its_fix_repairs_it(server_url: URL) -> None:
    """A deterministic collation other than the model's (``COLLATE "C"``, as a team may set for speed) only
    orders the indexes differently: a warning naming the column, whose fix restores the model's collation."""
    with migrated_database(server_url, "head", "sa_outbox_doc") as (_url, engine):
        with engine.begin() as conn:
            conn.execute(text('ALTER TABLE outbox ALTER COLUMN aggregate_id TYPE text COLLATE "C"'))
        found = _non_ok(run(engine))
        assert [(c, t, s) for c, t, s, _ in found] == [("columns", "outbox", "warn")], found
        assert 'aggregate_id: pg_catalog."C", expected pg_catalog."default"' in found[0][3]
        [finding] = [f for f in run(engine) if f.status == "warn" and f.table == "outbox"]
        assert finding.fix is not None
        with engine.begin() as conn:  # the fix as given repairs it
            conn.execute(text(finding.fix.splitlines()[-1]))
        assert _non_ok(run(engine)) == []


def test_a_nondeterministic_collation_is_a_failure(server_url: URL) -> None:
    """An ICU collation that ignores case makes "Order-1" and "order-1" one unique key (and one aggregate, one
    queue): a failure. A server built without ICU (the embedded one) cannot have such a column at all."""
    with migrated_database(server_url, "head", "sa_outbox_doc") as (_url, engine):
        try:
            with engine.begin() as conn:
                conn.execute(text("CREATE COLLATION ci (provider = icu, locale = 'und-u-ks-level2', "
                                  "deterministic = false)"))  # fmt: skip
        except DBAPIError as exc:
            assert "ICU is not supported" in str(exc.orig), exc
            return
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE jobs ALTER COLUMN unique_key TYPE text COLLATE ci"))
        found = _non_ok(run(engine))
        assert [(c, t, s) for c, t, s, _ in found] == [("columns", "jobs", "fail")], found
        assert 'unique_key: public.ci, expected pg_catalog."default"' in found[0][3]
        assert "nondeterministic" in found[0][3]
        [finding] = [f for f in run(engine) if f.status == "fail"]
        with engine.begin() as conn:
            conn.execute(text(str(finding.fix).splitlines()[-1]))
        assert _non_ok(run(engine)) == []


def test_a_collation_fix_quotes_a_column_name_that_needs_it(server_url: URL) -> None:
    """A column of the team's own on the model whose name needs quoting ("TenantId"): the fix quoted only the
    table, and failed on the column (a review: column "tenantid" does not exist)."""

    class QuotedBase(DeclarativeBase):
        pass

    class TenantJob(JobMixin, QuotedBase):
        __tablename__ = "tenant_jobs"
        tenant: Mapped[str | None] = mapped_column("TenantId", Text)

    with scratch_database(server_url, "sa_outbox_doc") as url:
        engine = create_engine(url, poolclass=NullPool)
        try:
            QuotedBase.metadata.create_all(engine)
            with engine.begin() as conn:
                conn.execute(text('ALTER TABLE tenant_jobs ALTER COLUMN "TenantId" TYPE text COLLATE "C"'))
            [finding] = [f for f in doctor(engine, [TenantJob]) if f.status != "ok" and f.table is not None]
            assert finding.status == "warn" and 'ALTER COLUMN "TenantId"' in str(finding.fix), finding
            with engine.begin() as conn:
                conn.execute(text(str(finding.fix).splitlines()[-1]))
            assert _non_ok(doctor(engine, [TenantJob])) == []
        finally:
            engine.dispose()
