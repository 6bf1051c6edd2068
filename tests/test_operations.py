"""Operating it: status/check/dead/purge report and change exactly what they say."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest
from sqlalchemy import Engine, event, text
from sqlalchemy.engine import URL

from sa_outbox._cli import main
from sa_outbox.errors import ConfigurationError
from sa_outbox.models import Job, OutboxEvent
from sa_outbox.monitoring import purge, queue_status

from .helpers import ids_with_status, queue_tables_shaped, row, seed_events, seed_jobs, statuses
from .sessions import open_snapshot


def cli(capsys: pytest.CaptureFixture[str], url: URL, *argv: str) -> tuple[int, str]:
    code = main([*argv, "--url", url.render_as_string(hide_password=False)])
    return code, capsys.readouterr().out


def _seed_known_state(engine: Engine) -> None:
    seed_events(engine, 10)  # ids 1..10
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE outbox SET created_at = now() - interval '100 seconds', "
                "available_at = now() - interval '100 seconds' WHERE id = 1"
            )
        )
        conn.execute(text("UPDATE outbox SET attempts = 2 WHERE id = 2"))
        conn.execute(
            text(
                "UPDATE outbox SET status = 'processing', attempts = 1, lease_version = 1, lease_owner = 'w', "
                "lease_until = now() + interval '1 minute' WHERE id = 4"
            )
        )
        conn.execute(
            text(
                "UPDATE outbox SET status = 'processing', attempts = 3, lease_version = 3, lease_owner = 'w', "
                "lease_until = now() - interval '1 minute' WHERE id = 5"
            )
        )
        conn.execute(
            text("UPDATE outbox SET status = 'dead', attempts = 12, last_error = 'boom' WHERE id = 6")
        )
        conn.execute(text("UPDATE outbox SET status = 'done', done_at = now() WHERE id > 6"))


def test_status_json_reports_exact_figures(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    _seed_known_state(engine)
    code, out = cli(capsys, db_url, "status", "--json")
    assert code == 0
    report = json.loads(out)["outbox"]
    assert report["counts"] == {"pending": 3, "processing": 2, "dead": 1, "done": 4}
    assert report["done_is_estimate"] is False
    assert 100 <= report["oldest_pending_age"] < 110  # due 100 s ago, not started: the alerting number
    assert 100 <= report["oldest_unfinished_age"] < 110
    assert report["expired_leases"] == 1
    assert report["attempts"] == {"0": 2, "1": 1, "2": 1, "3": 1}
    assert report["dead"] == 1
    assert any("1 expired lease" in w for w in report["warnings"])
    assert json.loads(out)["jobs"]["counts"] == {
        "queued": 0,
        "running": 0,
        "failed": 0,
        "cancelled": 0,
        "done": 0,
    }


def test_status_human_output_names_the_numbers(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    _seed_known_state(engine)
    code, out = cli(capsys, db_url, "status")
    assert code == 0
    assert "pending 3   processing 2   dead 1   done 4" in out
    assert "expired leases" in out and "oldest unfinished age" in out


def test_status_warns_about_a_transaction_holding_back_the_xmin_horizon(engine: Engine) -> None:
    seed_events(engine, 1)
    with engine.connect() as holder:
        pid = open_snapshot(holder, "long-report", "SELECT count(*) FROM outbox")
        time.sleep(0.15)
        report = queue_status(engine, OutboxEvent, long_transaction=0.1)
        holder.rollback()
    assert any(h.pid == pid and h.name == "long-report" for h in report.horizon)
    assert any(f"pid {pid}" in w and "xmin horizon" in w for w in report.horizon_warnings)
    assert not any("xmin horizon" in w for w in report.warnings)  # table warnings: about this table only
    after = queue_status(engine, OutboxEvent, long_transaction=0.1)
    assert not any(h.pid == pid for h in after.horizon)


def test_check_exits_zero_and_non_zero_at_the_thresholds(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    _seed_known_state(engine)
    assert cli(capsys, db_url, "check", "--max-dead", "1", "--max-expired-leases", "1")[0] == 0
    code, out = cli(capsys, db_url, "check", "--max-dead", "0")
    assert code == 1 and out.strip() == "FAIL: outbox: 1 dead > 0 (ok: jobs)"
    code, out = cli(capsys, db_url, "check", "--max-oldest-pending-age", "1m")
    assert code == 1 and "oldest pending age" in out and "> 60s" in out
    assert cli(capsys, db_url, "check", "--max-oldest-pending-age", "5m")[0] == 0
    code, out = cli(capsys, db_url, "check", "--max-expired-leases", "0", "--json")
    assert code == 1 and json.loads(out)["problems"] == ["outbox: 1 expired leases > 0"]


def test_dead_retry_and_skip_change_exactly_the_selected_rows(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    seed_events(engine, 5, aggregate="X", event_type="A")
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE outbox SET status = 'dead', attempts = 12, last_error = 'Timeout talking to broker' WHERE id IN (1, 2)"
            )
        )
        conn.execute(
            text(
                "UPDATE outbox SET status = 'dead', attempts = 1, last_error = '422 invalid', event_type = 'B' WHERE id = 3"
            )
        )
    code, out = cli(capsys, db_url, "dead", "list", "--json")
    assert code == 0 and [r["id"] for r in json.loads(out)] == [1, 2, 3]
    code, out = cli(capsys, db_url, "dead", "retry", "--error", "Timeout", "--dry-run", "--json")
    assert json.loads(out) == {"dry_run": True, "requeued": [1, 2], "passed_over": []}
    assert ids_with_status(engine, "dead") == [1, 2, 3]  # dry run changed nothing
    code, out = cli(capsys, db_url, "dead", "retry", "--error", "Timeout", "--json")
    assert json.loads(out)["requeued"] == [1, 2]
    assert (row(engine, "outbox", 1).status, row(engine, "outbox", 1).attempts) == ("pending", 0)
    code, out = cli(capsys, db_url, "dead", "skip", "3", "--json")
    assert json.loads(out)["skipped"] == [3]
    assert row(engine, "outbox", 3).status == "done"
    assert "skipped by operator" in row(engine, "outbox", 3).last_error
    assert statuses(engine) == {"pending": 4, "done": 1}
    code, out = cli(capsys, db_url, "dead", "show", "3")
    assert code == 2  # not dead any more: a clear error


def test_dead_retry_needs_a_selection(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["dead", "retry", "--url", db_url.render_as_string(hide_password=False)])
    assert code == 2
    err = capsys.readouterr().err
    assert "name the rows to retry: ids, a filter (--event-type" in err and "or --all" in err


def test_failed_jobs_through_the_cli(engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]) -> None:
    seed_jobs(engine, 2, task="mail", queue="q1")
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE jobs SET status = 'failed', attempts = 3, last_error = 'smtp' WHERE id = 1")
        )
    code, out = cli(capsys, db_url, "dead", "retry", "--jobs", "--task", "mail", "--json")
    assert code == 0 and json.loads(out)["requeued"] == [1]
    assert statuses(engine, "jobs") == {"queued": 2}


def test_purge_deletes_done_rows_in_bounded_batches_and_leaves_the_rest(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status, done_at) "
                "SELECT 'o', g::text, 'E', '{}', 'done', now() - interval '8 days' FROM generate_series(1, 200000) g"
            )
        )
    seed_events(engine, 5)  # pending: never touched
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE outbox SET status = 'done', done_at = now() WHERE id = 200001")
        )  # recent done
    assert purge(engine, OutboxEvent, older_than=7 * 86400, dry_run=True) == 200000
    deletes: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("DELETE"):
            deletes.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    try:
        assert purge(engine, OutboxEvent, older_than=7 * 86400, batch_size=10_000) == 200000
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert len(deletes) == 21  # 20 full batches and the one that found nothing left
    assert statuses(engine) == {"pending": 4, "done": 1}
    assert purge(engine, Job, older_than=0) == 0


def test_cli_errors_are_one_clear_line(capsys: pytest.CaptureFixture[str], db_url: URL) -> None:
    assert main(["status", "--url", "", "--json"]) == 2
    assert "no database URL" in capsys.readouterr().err
    code = main(
        [
            "status",
            "--url",
            db_url.render_as_string(hide_password=False),
            "--outbox-table",
            "nope",
            "--jobs-table",
            "nope2",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "no table nope, nope2 in this database" in err and "alembic upgrade head" in err
    with pytest.raises(SystemExit) as info:
        main(["purge", "--older-than", "soon"])
    assert info.value.code == 2 and "invalid duration 'soon'" in capsys.readouterr().err


def test_purge_fixes_its_cutoff_when_it_starts_and_does_not_chase_rows_finished_meanwhile(
    engine: Engine,
) -> None:
    seed_events(engine, 60)
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE outbox SET status = 'done', done_at = now() - interval '1 hour' WHERE id <= 30")
        )
    finished_meanwhile = iter(range(31, 61))

    def finish_one_more(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        # Dispatchers keep finishing messages while the purge runs: one more done row before each batch.
        if statement.lstrip().upper().startswith("DELETE"):
            n = next(finished_meanwhile, None)
            if n is not None:
                with engine.begin() as other:
                    other.execute(
                        text("UPDATE outbox SET status = 'done', done_at = now() WHERE id = :n"), {"n": n}
                    )

    assert purge(engine, OutboxEvent, older_than=0, dry_run=True) == 30
    event.listen(engine, "before_cursor_execute", finish_one_more)
    try:
        deleted = purge(engine, OutboxEvent, older_than=0, batch_size=1)
    finally:
        event.remove(engine, "before_cursor_execute", finish_one_more)
    assert deleted == 30  # what was done before it started; the dry run said the same
    assert statuses(engine) == {"done": 30}


@pytest.mark.timeout(60)  # a batch size of 0 used to loop forever
@pytest.mark.parametrize("batch_size", [0, -1, 1.5])
def test_purge_refuses_a_batch_size_below_one(engine: Engine, batch_size: Any) -> None:
    seed_events(engine, 2)
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox SET status = 'done', done_at = now() - interval '1 day'"))
    with pytest.raises(ConfigurationError, match=r"batch_size must be an integer >= 1"):
        purge(engine, OutboxEvent, older_than=60, batch_size=batch_size)
    assert statuses(engine) == {"done": 2}


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["purge", "--older-than", "7d", "--batch-size", "0"],
            "--batch-size: must be an integer >= 1, got '0'",
        ),
        (
            ["purge", "--older-than", "7d", "--batch-size", "-3"],
            "--batch-size: must be an integer >= 1, got '-3'",
        ),
        (["dead", "retry", "--all", "--batch-size", "0"], "--batch-size: must be an integer >= 1, got '0'"),
        (["dead", "skip", "--all", "--batch-size", "x"], "--batch-size: must be an integer >= 1, got 'x'"),
        (["dead", "list", "--limit", "-1"], "--limit: must be an integer >= 1, got '-1'"),
        (["check", "--max-dead", "-1"], "--max-dead: must be an integer >= 0, got '-1'"),
        (
            ["check", "--max-expired-leases", "two"],
            "--max-expired-leases: must be an integer >= 0, got 'two'",
        ),
        (["status", "--long-transaction", "-5"], "--long-transaction: invalid duration '-5'"),
        (["status", "--stale-after", "0"], "--stale-after: must be a duration > 0"),
        (["doctor", "--stale-after", "soon"], "--stale-after: invalid duration 'soon'"),
    ],
)
def test_cli_numeric_options_are_validated_with_a_clear_message(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err, err
    assert "Traceback" not in err


def test_check_alerts_on_rows_due_and_waiting_not_on_rows_scheduled_for_later(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    with engine.begin() as conn:
        conn.execute(  # enqueued two days ago to run tomorrow
            text(
                "INSERT INTO jobs (task, queue, payload, created_at, run_at) "
                "VALUES ('report', 'default', '{}', now() - interval '2 days', now() + interval '1 day')"
            )
        )
        conn.execute(  # written an hour ago, deferred by its publisher for another hour
            text(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at, available_at, "
                "attempts) VALUES ('order', '1', 'E', '{}', now() - interval '1 hour', now() + interval '1 hour', 1)"
            )
        )
    code, out = cli(capsys, db_url, "check", "--max-oldest-pending-age", "5m")
    assert code == 0, out
    code, out = cli(capsys, db_url, "status", "--json")
    report = json.loads(out)
    assert report["jobs"]["oldest_pending_age"] is None and report["outbox"]["oldest_pending_age"] is None
    assert report["jobs"]["oldest_unfinished_age"] > 2 * 86400 - 60  # still shown, for information
    assert 3600 <= report["outbox"]["oldest_unfinished_age"] < 3700
    with engine.begin() as conn:  # a job that has been due for ten minutes and nobody ran it
        conn.execute(
            text(
                "INSERT INTO jobs (task, queue, payload, run_at) "
                "VALUES ('mail', 'default', '{}', now() - interval '10 minutes')"
            )
        )
    code, out = cli(capsys, db_url, "check", "--max-oldest-pending-age", "5m")
    # (600 s, or a second or more on a slow machine: the clean-clone CI of 12-07 read 601 s)
    said = re.search(r"jobs: oldest pending age \(due, not started\) (\d+)s > 300s", out)
    assert code == 1 and said is not None and 600 <= int(said.group(1)) < 660, out


def _long_running_job(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO jobs (task, queue, payload, status, attempts, lease_version, locked_by, locked_at) "
                "VALUES ('export', 'default', '{}', 'running', 1, 1, 'w', now() - interval '2 minutes')"
            )
        )


def test_expired_job_leases_are_counted_with_the_stale_after_given(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    _long_running_job(engine)  # healthy for a fleet with stale_after=10m, stale for the 60 s default
    assert cli(capsys, db_url, "check", "--max-expired-leases", "0")[0] == 1
    code, out = cli(capsys, db_url, "check", "--max-expired-leases", "0", "--stale-after", "10m")
    assert code == 0, out
    code, out = cli(capsys, db_url, "status", "--json", "--stale-after", "10m")
    assert json.loads(out)["jobs"]["expired_leases"] == 0 and json.loads(out)["jobs"]["stale_after"] == 600
    code, out = cli(capsys, db_url, "status", "--stale-after", "90s")
    assert "(running longer than stale_after 90s)" in out
    code, out = cli(capsys, db_url, "doctor", "--json", "--stale-after", "10m")
    stuck = [f for f in json.loads(out)["findings"] if f["check"] == "stuck rows" and f["table"] == "jobs"]
    assert [f["status"] for f in stuck] == ["ok"]


def test_queue_status_refuses_bad_options(engine: Engine) -> None:
    for bad, message in (
        ({"stale_after": 0}, "stale_after must be > 0"),
        ({"long_transaction": -1}, "long_transaction must be >= 0"),
        ({"done_count_cap": -1}, "done_count_cap must be an integer >= 0"),
        ({"blocked_limit": 0}, "blocked_limit must be an integer >= 1"),
    ):
        with pytest.raises(ConfigurationError, match=message):
            queue_status(engine, OutboxEvent, **bad)


def test_blocked_aggregates_are_read_through_the_aggregate_index_not_the_history(engine: Engine) -> None:
    from sa_outbox._sql import spec_for
    from sa_outbox.monitoring import _blocked_statement

    with queue_tables_shaped(engine, "history"):  # 118,000 done rows, 2,000 pending over 1,000 aggregates
        with engine.begin() as conn:
            conn.execute(
                text(
                    "UPDATE outbox SET status = 'dead' WHERE status = 'pending' AND id < 119000 AND id % 7 = 0"
                )
            )
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("ANALYZE outbox"))
        stmt = _blocked_statement(spec_for(OutboxEvent))
        with engine.connect() as conn:
            compiled = stmt.compile(dialect=conn.dialect)
            plan = conn.exec_driver_sql(
                "EXPLAIN (FORMAT JSON) " + str(compiled), compiled.construct_params({"n": 10})
            ).scalar_one()[0]["Plan"]
        report = queue_status(engine, OutboxEvent)

    def nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
        return [node, *(n for child in node.get("Plans", []) for n in nodes(child))]

    seq = [n for n in nodes(plan) if n["Node Type"] == "Seq Scan"]
    indexes = {n["Index Name"] for n in nodes(plan) if "Index Name" in n}
    # the aggregate index, and at most the dead rows' own index to find the dead heads: never the history
    assert not seq and "ix_outbox_aggregate" in indexes <= {"ix_outbox_aggregate", "ix_outbox_dead"}, (
        seq,
        indexes,
    )
    assert report.blocked_aggregates_total > 0 and len(report.blocked_aggregates) == 10


# --- deliveries failing because the destination is unavailable (issue #19 §1) ------------------------------


def _refunded_by_an_unreachable_broker(engine: Engine, n: int) -> None:
    """Rows as a real dispatcher leaves them when its broker cannot be reached: claimed, published to a port
    nothing listens on, given back with the attempt refunded. One older row was delivered before."""
    from sa_outbox import Dispatcher
    from sa_outbox.publishers.redis import RedisStreamPublisher
    from sa_outbox.testing import RecordingPublisher

    from .brokers import closed_port

    seed_events(engine, 1)
    Dispatcher(engine, OutboxEvent, RecordingPublisher(), listen=False).run_once()
    seed_events(engine, n, start=1)
    down = RedisStreamPublisher(f"redis://127.0.0.1:{closed_port()}/0", stream="s", timeout=1)
    d = Dispatcher(engine, OutboxEvent, down, listen=False)
    try:
        assert d.run_once() == n and d.circuit_open
    finally:
        d.close()


def test_status_says_deliveries_fail_because_the_destination_is_unavailable(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    healthy = queue_status(engine, OutboxEvent)
    assert healthy.destination_unavailable is None and healthy.last_done_age is None
    _refunded_by_an_unreachable_broker(engine, 3)
    s = queue_status(engine, OutboxEvent)
    outage = s.destination_unavailable
    assert outage is not None and outage.rows == 3 and outage.sampled == 3
    assert outage.error.startswith("DestinationUnavailable: ")
    assert s.attempts == {0: 3}  # refunded: the outage spent no attempt
    assert s.last_done_age is not None and 0 <= s.last_done_age < 60
    assert any("destination is unavailable" in w and "probing" in w for w in s.warnings)

    code, out = cli(capsys, db_url, "status", "--json")
    data = json.loads(out)["outbox"]
    assert code == 0 and data["destination_unavailable"]["rows"] == 3
    assert data["destination_unavailable"]["error"] == outage.error
    assert isinstance(data["last_done_age"], float) and isinstance(data["oldest_pending_age"], float)
    code, out = cli(capsys, db_url, "status")
    assert code == 0
    assert "destination           unavailable    3 of the 3 oldest due rows given back" in out
    assert "last done" in out and "oldest pending age" in out


def test_status_reads_the_outage_from_the_oldest_due_rows_through_the_ready_index(engine: Engine) -> None:
    """The check reads a few rows at the head of the ready index, never every pending row; and the last
    delivery is one entry of the done index."""
    from sqlalchemy.dialects import postgresql

    from sa_outbox._sql import spec_for
    from sa_outbox.monitoring import OUTAGE_SAMPLE, _last_done_statement, _oldest_due_statement

    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status, done_at) "
                "SELECT 'o', g::text, 'E', '{}', CASE WHEN g % 2 = 0 THEN 'pending' ELSE 'done' END, "
                "CASE WHEN g % 2 = 1 THEN now() END FROM generate_series(1, 40000) g"
            )
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("ANALYZE outbox"))
    spec = spec_for(OutboxEvent)
    plans = []
    with engine.connect() as conn:
        for stmt, params in (
            (_oldest_due_statement(spec), {"n": OUTAGE_SAMPLE}),
            (_last_done_statement(spec), {}),
        ):
            compiled = stmt.compile(dialect=postgresql.dialect())
            sql = "EXPLAIN (FORMAT JSON) " + str(compiled)
            plans.append(
                json.dumps(conn.exec_driver_sql(sql, compiled.construct_params(params)).scalar_one())
            )
    head, last = plans
    assert '"Node Type": "Limit"' in head and '"Index Name": "ix_outbox_ready"' in head, head
    assert '"Seq Scan"' not in head and '"Sort"' not in head, head
    assert '"Index Name": "ix_outbox_done"' in last and '"Seq Scan"' not in last, last
