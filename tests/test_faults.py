"""The CI-sized fault run: nothing lost, nothing leaked, duplicates only where a lease was lost."""

from __future__ import annotations

from dataclasses import asdict

from sqlalchemy import Engine
from sqlalchemy.engine import URL

from .faults import FaultConfig, run_faults


def test_fault_run_loses_nothing_and_leaks_nothing(engine: Engine, db_url: URL) -> None:
    cfg = FaultConfig()  # a few thousand events, >= 5 kills, >= 2 terminations, 1 broker restart
    report = run_faults(engine, db_url.render_as_string(hide_password=False), cfg)
    print("fault run:", {k: v for k, v in asdict(report).items() if k != "log"}, report.log)
    assert report.kills >= 5 and report.terminations >= 2 and report.broker_restarts == 1
    assert report.committed_events >= 2000
    assert report.undelivered == 0 and report.delivered_distinct == report.committed_events
    assert report.rolled_back_transactions > 0 and report.rolled_back_delivered == 0
    assert report.unexplained_duplicates == 0
    assert report.order_violations == 0
    assert report.jobs_handled_twice_unexplained == 0 and report.jobs_not_done == 0
    assert report.stuck_rows == 0
    assert report.not_stopped == 0, report.log
