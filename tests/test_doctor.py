"""doctor reports each unhealthy condition created on purpose, with its fix, and ok once it is removed;
locks shows a blocked UPDATE and its blocker."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.engine import URL

from sa_outbox._cli import main
from sa_outbox.doctor import Finding, doctor, locks
from sa_outbox.models import Job, OutboxEvent

from .helpers import seed_events


def by_check(findings: list[Finding], check: str, table: str | None = "outbox") -> list[Finding]:
    return [f for f in findings if f.check == check and (table is None or f.table == table)]


def run(engine: Engine, **kw: Any) -> list[Finding]:
    return doctor(engine, [OutboxEvent, Job], **kw)


def test_healthy_installation_is_all_ok(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    findings = run(engine)
    assert {f.status for f in findings} == {"ok"}, [f for f in findings if f.status != "ok"]
    assert main(["doctor", "--json", "--url", db_url.render_as_string(hide_password=False)]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


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
        holder.execute(text("SET application_name = 'nightly-report'"))
        holder.commit()
        holder.execution_options(isolation_level="REPEATABLE READ")
        holder.begin()
        holder.execute(text("SELECT count(*) FROM jobs"))
        pid = holder.execute(text("SELECT pg_backend_pid()")).scalar_one()
        time.sleep(1.1)
        [finding] = by_check(run(engine, long_transaction=1.0), "xmin horizon", None)
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
        and "RowShareLock on outbox" in finding.message
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


def test_locks_shows_a_blocked_update_and_its_blocker(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    seed_events(engine, 1)
    with engine.connect() as holder:
        holder.begin()
        holder.execute(text("SELECT id FROM outbox WHERE id = 1 FOR UPDATE"))
        holder_pid = holder.execute(text("SELECT pg_backend_pid()")).scalar_one()

        def blocked_update() -> None:
            with engine.connect() as other:
                other.execute(text("SET lock_timeout = '10s'"))
                other.execute(text("UPDATE outbox SET attempts = attempts + 1 WHERE id = 1"))
                other.commit()

        thread = threading.Thread(target=blocked_update)
        thread.start()
        deadline = time.monotonic() + 10
        waiting: list[Any] = []
        while time.monotonic() < deadline and not waiting:
            waiting = [lk for lk in locks(engine, ["outbox", "jobs"]) if holder_pid in lk.blocked_by]
            time.sleep(0.05)
        assert main(["locks", "--json", "--url", db_url.render_as_string(hide_password=False)]) == 0
        report = json.loads(capsys.readouterr().out)
        holder.rollback()
        thread.join(10)
    assert (
        waiting and "UPDATE outbox SET attempts" in waiting[0].query and waiting[0].wait_event_type == "Lock"
    )
    blocked = [r for r in report if holder_pid in r["blocked_by"]]
    assert blocked and any(r["pid"] == holder_pid and r["idle_in_transaction"] for r in report)
