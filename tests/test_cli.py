"""The command line as an operator meets it: one-line errors with distinct exit codes, output that survives a
closed pipe, log lines that carry their fields, and every operations command on tables outside ``public``."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.engine import URL

from sa_outbox._cli import EXIT_PIPE, EXIT_THRESHOLD, EXIT_UNREACHABLE, EXIT_USAGE, LogFormatter, main
from sa_outbox.models import model_for
from sa_outbox.monitoring import queue_status

from .conftest import ROOT
from .helpers import seed_events, seed_jobs, statuses
from .sessions import open_snapshot


def run(capsys: pytest.CaptureFixture[str], url: URL | str, *argv: str) -> tuple[int, str, str]:
    target = url if isinstance(url, str) else url.render_as_string(hide_password=False)
    code = main([*argv, "--url", target])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sa-outbox: error: ") and "Traceback" not in err, err
    return lines[0]


# --- errors and exit codes -----------------------------------------------------------------------------------


def test_exit_codes_are_distinct_and_documented() -> None:
    assert len({0, EXIT_THRESHOLD, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_PIPE}) == 5
    readme = (ROOT / "README.md").read_text()
    for code in (EXIT_THRESHOLD, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_PIPE):
        assert f"`{code}`" in readme


def test_an_unreachable_server_is_one_line_and_exit_3(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "postgresql+psycopg://postgres@127.0.0.1:1/postgres", "status")
    line = one_line_error(err)
    assert code == EXIT_UNREACHABLE != EXIT_THRESHOLD
    assert "cannot reach the database" in line and "Connection refused" in line


@pytest.mark.parametrize(
    "url",
    ["not a url", "postgresql+psycopg://postgres@127.0.0.1:notaport/x", "postgresql+nodriver://x/y"],
)
def test_a_malformed_url_is_one_line_and_a_usage_error(capsys: pytest.CaptureFixture[str], url: str) -> None:
    code, _, err = run(capsys, url, "check")
    assert code == EXIT_USAGE and "invalid database URL" in one_line_error(err)


def test_a_missing_database_fails_fast_naming_it(capsys: pytest.CaptureFixture[str], server_url: URL) -> None:
    missing = server_url.set(database=f"no_such_db_{uuid.uuid4().hex[:6]}")
    code, _, err = run(capsys, missing, "status")
    line = one_line_error(err)
    assert code == EXIT_USAGE
    assert f'database "{missing.database}" does not exist' in line and "retrying will not help" in line


def test_an_unknown_role_fails_fast_naming_it(capsys: pytest.CaptureFixture[str], server_url: URL) -> None:
    code, _, err = run(capsys, server_url.set(username="no_such_role_x1"), "check")
    assert code == EXIT_USAGE and 'role "no_such_role_x1" does not exist' in one_line_error(err)


def test_a_table_behind_the_code_names_the_migration(
    capsys: pytest.CaptureFixture[str], engine: Engine, db_url: URL
) -> None:
    """A jobs table made by an older revision (no concurrency_key, no <jobs>_queues table): the refusal says
    the schema may be behind and names the migration, instead of only PostgreSQL's '… does not exist' (a
    review: status, check, doctor, queues list, jobs cancel and dead list all stopped there)."""
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE old_jobs (LIKE jobs INCLUDING DEFAULTS)"))
        conn.execute(text("ALTER TABLE old_jobs DROP COLUMN concurrency_key"))
    try:
        code, _, err = run(capsys, db_url, "queues", "list", "--jobs-table", "old_jobs")
        line = one_line_error(err)
        assert code == EXIT_USAGE and "does not exist" in line and "alembic upgrade head" in line
    finally:
        with engine.begin() as conn:
            conn.execute(text("DROP TABLE old_jobs"))


def test_a_log_level_that_does_not_exist_is_refused(capsys: pytest.CaptureFixture[str], db_url: URL) -> None:
    code = main(["--log-level", "LOUD", "status", "--url", db_url.render_as_string(hide_password=False)])
    assert code == EXIT_USAGE and "invalid --log-level 'LOUD'" in one_line_error(capsys.readouterr().err)


def test_output_to_a_closed_pipe_ends_quietly(engine: Engine, db_url: URL) -> None:
    seed_events(engine, 3)
    read_end, write_end = os.pipe()
    os.close(read_end)  # `| head` that has already gone: every write meets EPIPE
    env = dict(os.environ, DATABASE_URL=db_url.render_as_string(hide_password=False))
    try:
        done = subprocess.run([sys.executable, "-m", "sa_outbox", "status"], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, timeout=60)  # fmt: skip
    finally:
        os.close(write_end)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.returncode == EXIT_PIPE


# --- what the commands say -----------------------------------------------------------------------------------


def test_check_with_no_threshold_fails_on_failed_jobs(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, db_url, "check")
    assert code == 0 and out.strip() == "OK: outbox, jobs (dead <= 0)"
    seed_jobs(engine, 1)
    with engine.begin() as conn:
        conn.execute(text("UPDATE jobs SET status = 'failed', last_error = 'smtp down'"))
    code, out, _ = run(capsys, db_url, "check")
    assert code == EXIT_THRESHOLD and out.strip() == "FAIL: jobs: 1 failed > 0 (ok: outbox)"
    code, out, _ = run(capsys, db_url, "check", "--max-expired-leases", "5")  # explicit thresholds only
    assert code == 0


def test_status_points_failed_jobs_at_dead_list_with_jobs(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    seed_jobs(engine, 1)
    with engine.begin() as conn:
        conn.execute(text("UPDATE jobs SET status = 'failed'"))
    code, out, _ = run(capsys, db_url, "status")
    assert code == 0 and "1 failed row(s) need a person (sa-outbox dead list --jobs)" in out


def test_dead_list_prints_the_last_line_of_last_error_as_text(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    seed_events(engine, 1)
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE outbox SET status = 'dead', last_error = 'Traceback:\nboom\nPermanentError: 422 invalid'"
            )
        )
    code, out, _ = run(capsys, db_url, "dead", "list")
    first = out.splitlines()[0]
    assert code == 0 and first.endswith("attempts=0  PermanentError: 422 invalid"), first
    assert "['" not in out


@pytest.mark.parametrize(
    "argv",
    [
        ("dead", "skip", "--queue", "mail", "--error", "timeout"),  # an outbox skip with a jobs filter
        ("dead", "retry", "--task", "send_email"),
        ("dead", "retry", "--task", "t", "1"),
        ("dead", "list", "--queue", "mail"),
        # a jobs retry, an outbox filter
        ("dead", "retry", "--jobs", "--event-type", "E1", "--older-than", "0s"),
        ("dead", "skip", "--jobs", "--aggregate", "a1", "--all"),
    ],
)
def test_a_dead_filter_of_the_other_table_is_refused_and_nothing_changes(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]
) -> None:
    """A filter that does not apply to the table the command acts on is an error naming it — never dropped,
    which acted on every row the remaining filters matched (a hostile review: ``dead skip --queue mail --error
    timeout`` without ``--jobs`` marked every dead outbox row with "timeout" done, undelivered)."""
    seed_events(engine, 3)
    seed_jobs(engine, 3)
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox SET status = 'dead', last_error = 'timeout'"))
        conn.execute(text("UPDATE jobs SET status = 'failed', last_error = 'timeout'"))
    code, out, err = run(capsys, db_url, *argv)
    line = one_line_error(err)
    assert code == EXIT_USAGE and out == "", (code, out)
    flag = next(a for a in argv if a in ("--queue", "--task", "--event-type", "--aggregate"))
    assert flag in line and ("--jobs" in line), line
    assert statuses(engine) == {"dead": 3} and statuses(engine, "jobs") == {"failed": 3}


def test_status_names_the_ordered_aggregates_blocked_behind_a_dead_message(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    seed_events(engine, 3, aggregate="A")  # 1, 2, 3
    seed_events(engine, 2, aggregate="B", start=3)  # 4, 5
    seed_events(engine, 1, aggregate="C", start=5)  # 6: dead, nothing behind it
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox SET status = 'dead' WHERE id IN (1, 2, 4, 6)"))
    report = queue_status(engine, model_for("outbox", "outbox"))
    assert [(b.aggregate_id, b.dead_id, b.waiting) for b in report.blocked_aggregates] == [
        ("A", 1, 1),
        ("B", 4, 1),
    ]
    assert report.blocked_aggregates_total == 2
    code, out, _ = run(capsys, db_url, "status")
    assert code == 0
    assert "blocked aggregate       order/A: 1 pending behind dead 1 (sa-outbox dead show 1)" in out
    assert "order/B: 1 pending behind dead 4" in out and "order/C" not in out
    assert "2 aggregate(s) have pending messages behind a dead one" in out


def test_status_says_each_horizon_warning_once(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    with engine.connect() as holder:
        pid = open_snapshot(holder, "long-report", "SELECT count(*) FROM jobs")
        code, out, _ = run(capsys, db_url, "status", "--long-transaction", "0")
        holder.rollback()
    assert code == 0 and out.count(f"transaction pid {pid} (long-report") == 1, out


def test_the_cli_log_format_shows_a_records_extra_fields(engine: Engine, db_url: URL) -> None:
    record = logging.makeLogRecord({"name": "sa_outbox.worker", "levelname": "INFO", "msg": "batch done",
                                    "claimed": 5, "queue": "mail", "error": "a b"})  # fmt: skip
    assert LogFormatter().format(record).endswith('batch done claimed=5 queue=mail error="a b"')
    seed_events(engine, 2)
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox SET status = 'dead'"))
    env = dict(os.environ, DATABASE_URL=db_url.render_as_string(hide_password=False))
    done = subprocess.run([sys.executable, "-m", "sa_outbox", "dead", "retry", "--all"], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "requeued 2 dead row(s) of outbox" in done.stderr
    assert "table=outbox action=retry selected=2 changed=2" in done.stderr


# --- tables outside public --------------------------------------------------------------------------------


@pytest.fixture
def app_schema(engine: Engine) -> Iterator[str]:
    """Outbox and jobs tables in schema ``app`` (not on the search path), as the mixins create them."""
    with engine.begin() as conn:
        conn.execute(text("CREATE SCHEMA app"))
        for kind in ("outbox", "jobs"):
            model_for(kind, kind, "app").__table__.create(conn)
    try:
        yield "app"
    finally:
        with engine.begin() as conn:
            conn.execute(text("DROP SCHEMA app CASCADE"))


def test_every_operations_command_works_on_schema_qualified_tables(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str], app_schema: str
) -> None:
    tables = ("--outbox-table", "app.outbox", "--jobs-table", "app.jobs")
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO app.outbox (aggregate_type, aggregate_id, event_type, payload, status, done_at) VALUES "
                "('o', '1', 'E', '{}', 'dead', NULL), ('o', '1', 'E', '{}', 'pending', NULL), "
                "('o', '2', 'E', '{}', 'done', now() - interval '2 days')"
            )
        )
    seed_events(engine, 1)  # public.outbox: must stay untouched
    code, out, err = run(capsys, db_url, "status", "--json", *tables)
    report = json.loads(out)
    assert code == 0 and set(report) == {"app.outbox", "app.jobs"}, err
    assert report["app.outbox"]["counts"] == {"pending": 1, "processing": 0, "dead": 1, "done": 1}
    assert "sa-outbox dead list --outbox-table app.outbox" in " ".join(report["app.outbox"]["warnings"])
    code, out, _ = run(capsys, db_url, "check", *tables)
    assert code == EXIT_THRESHOLD and out.strip() == "FAIL: app.outbox: 1 dead > 0 (ok: app.jobs)"
    code, out, _ = run(capsys, db_url, "dead", "retry", "--all", "--json", *tables)
    assert code == 0 and json.loads(out)["requeued"] == [1]
    code, out, _ = run(capsys, db_url, "purge", "--older-than", "1d", "--json", *tables)
    assert code == 0 and json.loads(out)["deleted"] == {"app.outbox": 1, "app.jobs": 0}
    code, out, _ = run(capsys, db_url, "doctor", "--json", *tables)
    findings = json.loads(out)["findings"]
    indexes = [f for f in findings if f["check"] == "indexes"]
    assert [(f["table"], f["status"]) for f in indexes] == [("app.outbox", "ok"), ("app.jobs", "ok")]
    assert "all 5 partial indexes" in indexes[0]["message"]
    assert code == 0 and not [f for f in findings if f["status"] == "fail"]
    code, out, _ = run(capsys, db_url, "locks", "--json", *tables)
    assert code == 0 and json.loads(out) == []
    assert statuses(engine) == {"pending": 1}


def test_a_table_in_another_schema_is_pointed_at_not_called_missing(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str], app_schema: str
) -> None:
    code, _, err = run(capsys, db_url, "status", "--outbox-table", "orders_outbox", "--jobs-table", "jobs_x")
    assert code == EXIT_USAGE and "no table orders_outbox, jobs_x in this database" in one_line_error(err)
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE app.outbox RENAME TO orders_outbox"))
    code, _, err = run(capsys, db_url, "dead", "list", "--outbox-table", "orders_outbox")
    line = one_line_error(err)
    assert code == EXIT_USAGE and "pass --outbox-table app.orders_outbox" in line
    assert "alembic" not in line  # running the migration would create a second table in public
    code, _, err = run(capsys, db_url, "status", "--outbox-table", "a.b.c")
    assert code == EXIT_USAGE and "give a table name or schema.table" in one_line_error(err)


@pytest.mark.parametrize(
    "command",
    [
        ("check",),
        ("status",),
        ("doctor",),
        ("purge", "--older-than", "7d", "--dry-run"),
        ("dead", "list"),
        ("dead", "list", "--jobs"),
    ],
)
def test_a_table_named_on_the_command_line_that_does_not_exist_is_an_error(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str], command: tuple[str, ...]
) -> None:
    """A typo in --outbox-table/--jobs-table: before, the command went on with the other table — ``check``
    printed OK, exit 0 — so a monitor with a typo stayed green for good. A default table that does not exist
    is still skipped when the other one does (a service with jobs only)."""
    for option in ("--outbox-table", "--jobs-table"):
        code, out, err = run(capsys, db_url, *command, option, "outbx")
        # (dead acts on one table: the other's option is refused as not its own)
        expected = (
            "no table outbx in this database"
            if command[0] != "dead" or (option == "--jobs-table") == ("--jobs" in command)
            else "table, but this command acts on"
        )
        assert code == EXIT_USAGE and expected in one_line_error(err), (out, err)
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE outbox RENAME TO outbox_gone"))
    try:
        code, out, err = run(capsys, db_url, "check")
        assert code == 0 and "jobs" in out and err == "", (out, err)
    finally:
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE outbox_gone RENAME TO outbox"))


def test_queue_status_reads_a_schema_qualified_table_and_its_statistics(
    engine: Engine, app_schema: str
) -> None:
    report = queue_status(engine, model_for("outbox", "outbox", "app"))
    assert report.table == "app.outbox" and report.counts["pending"] == 0
    assert report.health is not None  # pg_stat_user_tables found app.outbox, not public.outbox


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port whose server takes the TCP connection and never answers (a hung server, a frozen network)."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)  # never accepted: the kernel completes the handshakes, nobody ever speaks
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def test_a_command_waiting_on_a_silent_server_times_out_as_unreachable(silent_server: int) -> None:
    """Before: psycopg's 130 s connect timeout, then exit 2 'the database refused the command: connection
    timeout expired'. Now the URL's connect_timeout (else 10 s) and exit 3, worth retrying."""
    url = f"postgresql://postgres@127.0.0.1:{silent_server}/x?connect_timeout=1"
    done = subprocess.run([sys.executable, "-m", "sa_outbox", "status", "--url", url], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)  # fmt: skip
    assert done.returncode == EXIT_UNREACHABLE and "cannot reach the database" in done.stderr, done.stderr


def test_a_stop_during_a_start_up_on_a_silent_server_is_a_stop_not_an_unreachable_database(
    silent_server: int,
) -> None:
    """A loop stopped while its first connect hangs: when the connect gave up past ``startup_timeout``, run()
    raised "database unreachable" (``sa-outbox worker``: exit 2) instead of stopping as asked (a review)."""
    import threading

    from sqlalchemy import create_engine

    from sa_outbox import Worker
    from sa_outbox.models import Job

    engine = create_engine(f"postgresql+psycopg://postgres@127.0.0.1:{silent_server}/x?connect_timeout=2")
    try:
        w = Worker(engine, Job, {"t": lambda job: None})
        threading.Timer(0.5, w.stop).start()  # while the first connect waits (2 s)
        w.run(install_signal_handlers=False, startup_timeout=1)  # returns: no ConfigurationError
        assert w.stats.claimed == 0 and w.stats.db_errors >= 1
    finally:
        engine.dispose()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_one_shot_command_ends_at_a_stop_signal(silent_server: int, sig: signal.Signals) -> None:
    """Before: status/check/purge only remembered SIGTERM and SIGINT, as a loop does, and one waiting on a
    silent server could be ended only by SIGKILL. Now exit 128 + the signal, saying what stays committed."""
    url = f"postgresql://postgres@127.0.0.1:{silent_server}/x?connect_timeout=120"
    proc = subprocess.Popen([sys.executable, "-m", "sa_outbox", "check", "--url", url], stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True, cwd=ROOT)  # fmt: skip
    try:
        time.sleep(2)  # (connecting by now)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig and f"stopped by {sig.name}" in err, (proc.returncode, err)


def test_dead_list_says_when_more_rows_match_than_it_lists(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: a silent cut at --limit (100 of 25,002 read as all of them, in text and in JSON)."""
    seed_jobs(engine, 4, task="t", status="failed")
    code, out, err = run(capsys, db_url, "dead", "list", "--jobs", "--limit", "3")
    assert code == 0 and out.splitlines()[-1] == "3 row(s), more match (--limit)"
    assert "the first 3 row(s); more match" in err
    code, out, err = run(capsys, db_url, "dead", "list", "--jobs", "--json", "--limit", "3")
    assert code == 0 and len(json.loads(out)) == 3 and "more match" in err
    code, out, err = run(capsys, db_url, "dead", "list", "--jobs", "--limit", "4")
    assert code == 0 and out.splitlines()[-1] == "4 row(s)" and err == ""
    code, _, err = run(capsys, db_url, "dead", "show", "2")
    assert code == EXIT_USAGE and "(a failed job? add --jobs)" in one_line_error(err)


def test_a_bulk_command_cut_off_part_way_says_what_it_had_done(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    """A database error at the third batch (here a trigger's; a review: an outage through a proxy): before,
    only the error — 22,000 rows already deleted and 4,600 requeued went unsaid. Now what the committed batches
    did, and that running the command again goes on."""
    seed_jobs(engine, 4, task="t", status="failed")
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE jobs SET status = 'done', finished_at = now() - interval '1 day' WHERE id = 4")
        )
        conn.execute(text("INSERT INTO jobs (task, payload, status, finished_at) SELECT 't', '{}', 'done', "
                          "now() - interval '1 day' FROM generate_series(1, 3)"))  # fmt: skip
        conn.execute(text(
            "CREATE FUNCTION no_third() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF OLD.id IN (3, 6) THEN RAISE EXCEPTION 'refused row %', OLD.id; END IF; "
            "RETURN CASE TG_OP WHEN 'DELETE' THEN OLD ELSE NEW END; END $$"))  # fmt: skip
        conn.execute(text("CREATE TRIGGER no_third BEFORE UPDATE OR DELETE ON jobs FOR EACH ROW "
                          "EXECUTE FUNCTION no_third()"))  # fmt: skip
    try:
        code, _, err = run(capsys, db_url, "dead", "retry", "--jobs", "--all", "--batch-size", "1")
        assert code == EXIT_USAGE and "refused row 3" in err
        assert "before the error 2 row(s) changed (committed, batch by batch)" in err, err
        code, _, err = run(
            capsys, db_url, "purge", "--jobs-table", "jobs", "--older-than", "1h", "--batch-size", "1"
        )
        assert code == EXIT_USAGE and "refused row 6" in err and "before the error 2 row(s) deleted" in err, (
            err
        )
    finally:
        with engine.begin() as conn:
            conn.execute(text("DROP TRIGGER no_third ON jobs"))
            conn.execute(text("DROP FUNCTION no_third()"))


# --- ids named but left alone; messages in the command line's words -------------------------------------------


def test_ids_a_command_leaves_alone_are_named_with_their_status_and_exit_1(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    """``jobs cancel 123`` of a job that does not exist, or finished a moment ago, printed "cancelled 0" and
    exited 0: a script could not tell that its cancel did not land (a review). Each id left alone is named on
    stderr with its status now, ``--json`` lists them, the exit code is 1 — and the other ids were acted on."""
    seed_jobs(engine, 3)
    with engine.begin() as conn:
        conn.execute(text("UPDATE jobs SET status = 'done', finished_at = now() WHERE id = 2"))
        conn.execute(text("UPDATE jobs SET status = 'failed', last_error = 'x' WHERE id = 3"))
    code, out, err = run(capsys, db_url, "jobs", "cancel", "1", "2", "999999")
    assert code == EXIT_THRESHOLD and out.startswith("cancelled 1 queued job(s)"), (code, out)
    assert "2 of the 3 named id(s) were not cancelled: 2 (done), 999999 (no such row)" in err, err
    assert statuses(engine, "jobs") == {"cancelled": 1, "done": 1, "failed": 1}
    code, out, err = run(capsys, db_url, "jobs", "retry", "1", "2", "--json")
    assert code == EXIT_THRESHOLD and json.loads(out) == {
        "dry_run": False, "requeued": [1], "passed_over": [{"id": 2, "status": "done"}]
    }  # fmt: skip
    code, out, err = run(capsys, db_url, "jobs", "update", "1", "2", "--priority", "5", "--dry-run")
    assert code == EXIT_THRESHOLD and "1 of the 2 named id(s) would not be updated: 2 (done)" in err, err
    code, out, err = run(capsys, db_url, "dead", "skip", "--jobs", "3", "1")
    assert code == EXIT_THRESHOLD and "were not discarded: 1 (queued) — this acts on failed jobs" in err, err
    assert statuses(engine, "jobs") == {"queued": 1, "done": 1, "cancelled": 1}
    # every id acted on: exit 0, nothing on stderr
    code, out, err = run(capsys, db_url, "jobs", "cancel", "1")
    assert (code, err) == (0, "")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (("jobs", "cancel"), "name the jobs to cancel: ids, --task or --queue"),
        (("jobs", "retry"), "name the jobs to retry: ids, --task, --queue or --all"),
        (("jobs", "update", "--priority", "1"), "name the jobs to update: ids, --task, --queue or --all"),
        (("jobs", "update", "1"), "jobs update needs at least one of --priority, --run-in, --max-attempts"),
        (("dead", "retry"), "name the rows to retry: ids, a filter (--event-type, --aggregate-type, --aggregate, "
                            "--error, --older-than), or --all"),
        (("dead", "skip", "--jobs"), "name the rows to skip: ids, a filter (--task, --queue, --error, "
                                     "--older-than), or --all"),
    ],
)  # fmt: skip
def test_a_command_with_nothing_to_act_on_says_so_in_its_own_options(
    db_url: URL, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], expected: str
) -> None:
    """The messages came from the Python functions: ``or all=True``, ``priority, run_at, max_attempts``."""
    code, out, err = run(capsys, db_url, *argv)
    assert code == EXIT_USAGE and out == "" and one_line_error(err) == f"sa-outbox: error: {expected}"


def test_pausing_a_queue_no_job_has_used_pauses_it_and_says_which_queues_exist(
    engine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    from sa_outbox.admin import list_queues
    from sa_outbox.models import Job

    seed_jobs(engine, 1, queue="Mail")
    code, out, err = run(capsys, db_url, "queues", "pause", "mail")
    assert code == 0 and out.startswith("paused mail")
    assert "no job is queued or running in 'mail'" in err and "known queues: 'Mail'" in err, err
    assert [q.name for q in list_queues(engine, Job) if q.paused] == ["mail"]  # ahead of its first job
    code, out, err = run(capsys, db_url, "queues", "pause", "Mail")
    assert code == 0 and "note" not in err, err
