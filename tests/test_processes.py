"""Real processes: CLI targets, graceful SIGTERM, database backends killed mid-run, kill -9, many workers."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL

from sa_outbox import _steps as eng

from .conftest import ROOT
from .factories import expire_leases
from .helpers import JOBS, seed_events, seed_jobs, statuses


@pytest.fixture
def side_tables(engine: Engine) -> Iterator[Engine]:
    with engine.begin() as conn:
        conn.execute(
            text(
                "CREATE TABLE IF NOT EXISTS deliveries (message_id bigint, pid int, at timestamptz DEFAULT clock_timestamp())"
            )
        )
        conn.execute(text("CREATE TABLE IF NOT EXISTS job_calls (job_id bigint, pid int)"))
        conn.execute(text("TRUNCATE deliveries, job_calls"))
    yield engine


def spawn(kind: str, url: URL, *args: str, **env: str) -> subprocess.Popen[str]:
    full_env = dict(os.environ, DATABASE_URL=url.render_as_string(hide_password=False), **env)
    return subprocess.Popen(
        [sys.executable, "-m", "sa_outbox", kind, f"tests.targets:{kind if kind == 'worker' else 'dispatcher'}", *args],
        cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def scalar(engine: Engine, sql: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(text(sql)).scalar_one()


def wait_for(predicate: Any, timeout: float = 30.0, every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(every)
    raise AssertionError("condition not reached in time")


def scalar_row(engine: Engine, sql: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(text(sql)).one()


def stop(proc: subprocess.Popen[str], timeout: float = 30.0) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def test_sigterm_mid_batch_exits_zero_with_every_claimed_message_finalized(
    side_tables: Engine, db_url: URL
) -> None:
    engine = side_tables
    seed_events(engine, 40)
    proc = spawn("dispatch", db_url, PUBLISH_DELAY="0.05", BATCH="10")
    wait_for(lambda: scalar(engine, "SELECT count(*) FROM deliveries") >= 3)
    code, out = stop(proc)
    assert code == 0, out
    assert scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'processing'") == 0
    # Every delivered message is recorded done; nothing done was left undelivered.
    assert (
        scalar(
            engine,
            "SELECT count(*) FROM deliveries d JOIN outbox o ON o.id = d.message_id WHERE o.status <> 'done'",
        )
        == 0
    )
    assert scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'done'") == scalar(
        engine, "SELECT count(*) FROM deliveries"
    )
    assert scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'pending' AND attempts <> 0") == 0
    assert (
        scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'pending'") > 0
    )  # it really stopped mid-way


def test_sigterm_right_after_start_up_exits_zero(side_tables: Engine, db_url: URL) -> None:
    proc = spawn("dispatch", db_url)

    def handler_installed() -> bool:  # SIGTERM (15) is bit 14 of the caught-signals mask
        with open(f"/proc/{proc.pid}/status") as status:
            lines = status.read().splitlines()
        for line in lines:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
        return False

    wait_for(handler_installed, timeout=10, every=0.001)  # the first thing python -m sa_outbox does
    assert proc.poll() is None  # still starting up: importing, loading the target
    code, out = stop(proc)
    assert code == 0, out


@pytest.mark.parametrize("mode", ["second", "in-log"])
@pytest.mark.parametrize("kind", ["worker", "dispatcher"])
def test_a_sigterm_at_any_line_of_the_handler_or_of_a_log_call_still_stops_the_loop(
    engine: Engine, db_url: URL, kind: str, mode: str
) -> None:
    """A signal runs its handler at whatever line the main thread is on, also inside a lock that thread
    holds. The child (tests/second_signal.py, logging through a QueueHandler) sends a SIGTERM at each line in
    turn of a watched call: ``second`` — a second SIGTERM inside the first one's handler (a supervisor's
    death sends two: the kernel's PR_SET_PDEATHSIG and the lifeline's; Ctrl-C twice); ``in-log`` — the one
    SIGTERM inside the loop's own log call. Before, the handler set a ``threading.Event`` and logged: its
    ``set()`` waited for the lock of the ``set()`` it interrupted, its log call for the QueueHandler's queue
    lock — forever (a pool's children outlived their killed supervisor). Every round must stop, and the loop
    still logs the signal, from its own code."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.second_signal", db_url.render_as_string(hide_password=False), kind, mode],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip

    # (the child's log records and its progress lines share the pipe, and may share a line)
    def rounds(out: str) -> list[int]:
        return [int(k) for k in re.findall(r"round (\d+) stopped", out)]

    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()  # SIGKILL: a deadlocked handler never runs a SIGTERM's
        out, _ = proc.communicate()
        raise AssertionError(
            f"hung in the round after round {rounds(out)[-1:] or 'the calibration'}"
        ) from None
    assert proc.returncode == 0, out[-3000:]
    lines = int(re.findall(r"watched lines (\d+)", out)[0])
    assert lines >= 3 and rounds(out) == list(range(1, lines + 1)), out[-3000:]  # a round for every line
    # calibration (3) and every round logged its signal, once its loop looked
    assert out.count("signal 15: finishing what is in hand, then stopping") >= lines + 3, out[-3000:]


@pytest.mark.parametrize("concurrency", ["1", "2"])
def test_a_stop_signal_during_a_long_job_is_logged_while_the_job_runs(
    side_tables: Engine, db_url: URL, tmp_path: Path, concurrency: str
) -> None:
    """An inline worker (concurrency 1) runs its job on the main thread: the signal's line was logged only
    after the job, so an operator stopping a worker in a long job saw nothing and reached for kill -9 (a
    review). The heartbeat thread now logs it, naming the job the stop waits for — while the job runs."""
    engine = side_tables
    gate = tmp_path / "gate"
    seed_jobs(engine, 1, task="record")
    proc = spawn("worker", db_url, GATE=str(gate), CONCURRENCY=concurrency)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        try:  # the handler runs (not merely claimed)
            wait_for((tmp_path / "gate.started").exists, timeout=60)
        except AssertionError:
            raise AssertionError(
                f"the job never started; the worker said: {''.join(lines)[-3000:]}"
            ) from None
        proc.send_signal(signal.SIGTERM)
        logged = lambda: [line for line in lines if "signal 15: finishing what is in hand" in line]  # noqa: E731
        wait_for(lambda: bool(logged()), timeout=20)  # (the job waits for the gate: up to 60 s)
        job_id = scalar(engine, "SELECT id FROM jobs")
        assert f"then stopping (running: job {job_id} 'record')" in logged()[0], logged()
        assert scalar(engine, "SELECT count(*) FROM jobs WHERE status = 'running'") == 1  # logged meanwhile
        gate.touch()
        assert proc.wait(timeout=30) == 0
    finally:
        gate.touch()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
        proc.stdout.close()  # type: ignore[union-attr]
    assert scalar_row(engine, "SELECT status, attempts FROM jobs") == ("done", 1)
    assert scalar(engine, "SELECT count(*) FROM job_calls") == 1
    assert sum("signal 15: finishing what is in hand" in line for line in lines) == 1  # logged once


def test_a_worker_that_stops_without_recording_what_it_ran_exits_3_not_0(
    side_tables: Engine, db_url: URL, tmp_path: Path
) -> None:
    """A stop whose last finalize fails (here a trigger refuses it; in life the database is out of reach)
    logged an error and exited 0 — "stopped cleanly" over a job left running, to be rescued and run again (two
    reviews). Now exit 3, and the log says what follows."""
    engine = side_tables
    gate = tmp_path / "gate"
    seed_jobs(engine, 1, task="record")
    proc = spawn("worker", db_url, GATE=str(gate))
    try:
        wait_for((tmp_path / "gate.started").exists)
        with engine.begin() as conn:
            conn.execute(text(
                "CREATE FUNCTION refuse_done() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                "RAISE EXCEPTION 'refused by the test'; END $$"
            ))  # fmt: skip
            conn.execute(text(
                "CREATE TRIGGER refuse_done BEFORE UPDATE ON jobs FOR EACH ROW "
                "WHEN (NEW.status <> 'running') EXECUTE FUNCTION refuse_done()"
            ))  # fmt: skip
        proc.send_signal(signal.SIGTERM)
        gate.touch()
        out, _ = proc.communicate(timeout=60)
    finally:
        gate.touch()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        with engine.begin() as conn:
            conn.execute(text("DROP TRIGGER IF EXISTS refuse_done ON jobs"))
            conn.execute(text("DROP FUNCTION IF EXISTS refuse_done()"))
    assert proc.returncode == 3, out[-3000:]
    assert (
        "could not finalize the jobs in hand" in out
        and "stopped without recording what it had in hand" in out
    )
    assert scalar(engine, "SELECT status FROM jobs") == "running"  # (what the exit code says)


def test_an_async_worker_process_ends_after_stop_with_a_handler_that_swallows_cancellation(
    side_tables: Engine, db_url: URL, tmp_path: Path
) -> None:
    """The loop abandons a handler that swallows its handler_timeout's cancellation, and stops; then
    asyncio.run's teardown waited for that task for good — ``sa-outbox worker`` logged "stopped" and never
    exited (a review: only SIGKILL ended it). serve() now leaves such a task a second after cancelling it."""
    engine = side_tables
    gate = tmp_path / "gate"
    seed_jobs(engine, 1, task="deaf")
    env = dict(os.environ, DATABASE_URL=db_url.render_as_string(hide_password=False), GATE=str(gate))
    proc = subprocess.Popen(
        [sys.executable, "-m", "sa_outbox", "worker", "tests.targets:deaf_async_worker"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_for((tmp_path / "gate.started").exists)
        wait_for(lambda: scalar(engine, "SELECT status FROM jobs") == "queued")  # abandoned: retried
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)  # (the deaf handler would hold it until the gate opens)
        except subprocess.TimeoutExpired:
            raise AssertionError("the process did not end after its stop") from None
    finally:
        gate.touch()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    assert "did not end within 1 s of their cancellation as the event loop closed: abandoned" in out, out[
        -3000:
    ]
    assert scalar(engine, "SELECT count(*) FROM jobs WHERE status = 'running'") == 0


def test_dispatcher_survives_its_backends_being_terminated_and_loses_nothing(
    side_tables: Engine, db_url: URL
) -> None:
    engine = side_tables
    victim = db_url.update_query_dict({"application_name": "victim"})
    proc = spawn("dispatch", victim, BATCH="5", PUBLISH_DELAY="0.002")
    total_killed = 0
    try:
        for round_ in range(4):
            seed_events(engine, 50, start=round_ * 50)
            wait_for(lambda n=round_: scalar(engine, "SELECT count(*) FROM deliveries") > n * 50)
            with engine.connect() as conn:
                killed = conn.execute(
                    text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                        "AND application_name IN ('victim', 'sa_outbox.listen')"
                    )
                ).scalar_one()
                conn.commit()
            total_killed += killed
        assert total_killed >= 2
        wait_for(lambda: statuses(engine) == {"done": 200}, timeout=60)
        assert proc.poll() is None  # still running
        assert scalar(engine, "SELECT count(DISTINCT message_id) FROM deliveries") == 200
    except AssertionError:
        code, out = stop(proc)
        raise AssertionError(out[-3000:]) from None
    code, out = stop(proc)
    assert code == 0, out
    assert "database" in out.lower()  # it logged the outage it rode out


def test_four_worker_processes_handle_5000_jobs_exactly_once(side_tables: Engine, db_url: URL) -> None:
    engine = side_tables
    seed_jobs(engine, 5000, task="record")
    proc = spawn("worker", db_url, "--processes", "4", BATCH="20")
    try:
        wait_for(lambda: statuses(engine, "jobs") == {"done": 5000}, timeout=120, every=0.2)
    finally:
        code, out = stop(proc)
    assert code == 0, out
    assert scalar(engine, "SELECT count(*) FROM job_calls") == 5000
    assert (
        scalar(
            engine,
            "SELECT count(*) FROM (SELECT job_id FROM job_calls GROUP BY job_id HAVING count(*) > 1) d",
        )
        == 0
    )
    assert scalar(engine, "SELECT count(DISTINCT pid) FROM job_calls") >= 2


def _naive_worker(url: str, rounds: int) -> None:  # pragma: no cover - child process
    """The jobs document's lock-free claim: SELECT the first queued id, then UPDATE it (two statements)."""
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        for _ in range(rounds):
            job_id = conn.execute(
                text("SELECT id FROM jobs WHERE status = 'queued' ORDER BY id LIMIT 1")
            ).scalar()
            if job_id is None:
                return
            conn.execute(text("UPDATE jobs SET status = 'running' WHERE id = :i"), {"i": job_id})
            conn.execute(
                text("INSERT INTO job_calls (job_id, pid) VALUES (:i, :p)"), {"i": job_id, "p": os.getpid()}
            )


def test_the_duplicate_check_can_fail_a_naive_claim_without_locks_duplicates(
    side_tables: Engine, db_url: URL
) -> None:
    engine = side_tables
    seed_jobs(engine, 500, task="record")
    ctx = multiprocessing.get_context("spawn")
    url = db_url.render_as_string(hide_password=False)
    procs = [ctx.Process(target=_naive_worker, args=(url, 1000)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    dups = scalar(
        engine, "SELECT count(*) FROM (SELECT job_id FROM job_calls GROUP BY job_id HAVING count(*) > 1) d"
    )
    assert dups > 0


def test_kill_9_worker_job_is_reaped_and_completed_and_old_token_is_fenced(
    side_tables: Engine, db_url: URL
) -> None:
    engine = side_tables
    seed_jobs(engine, 1, task="record")
    proc = spawn("worker", db_url, JOB_DELAY="60", STALE_AFTER="1")
    wait_for(lambda: statuses(engine, "jobs") == {"running": 1})
    with engine.connect() as conn:
        old = conn.execute(text("SELECT id, lease_version FROM jobs")).one()
    proc.kill()
    proc.communicate(timeout=10)
    expire_leases(engine, "jobs")  # stale_after has passed since the kill
    from sa_outbox import Worker
    from sa_outbox.models import Job

    calls: list[int] = []
    w = Worker(engine, Job, {"record": lambda j: calls.append(j.id)}, stale_after=1, listen=False)
    w.run_once()  # reaps the stale job
    w.run_once()  # and runs it
    assert calls == [old.id]
    with engine.connect() as conn:
        now = conn.execute(text("SELECT status, attempts, lease_version, last_error FROM jobs")).one()
    assert (now.status, now.attempts, now.lease_version) == ("done", 2, old.lease_version + 1)
    assert "lease expired (owner worker:" in now.last_error  # the reaper's note stays on the done job
    with engine.begin() as conn:
        assert (
            eng.finalize(conn, JOBS, [eng.Outcome(old.id, old.lease_version, "failed", error="zombie")])
            == set()
        )


def test_kill_9_while_a_claim_waits_behind_the_run_of_its_job_leaves_the_attempts_to_the_runs(
    side_tables: Engine, db_url: URL
) -> None:
    """A worker process runs a job of two attempts; another worker's rescue takes its lease back under the run
    and the process claims the job again (lease 2), held back behind its own run — then it is killed (-9). The
    held-back claim's attempt was given back at once: a rescue after the kill puts the job back, and it runs
    and is done on its second attempt — it is not failed "after max attempts (worker crash?)" with one run
    begun and none ended (a review saw that before the refund)."""
    engine = side_tables
    seed_jobs(engine, 1, task="record", max_attempts=2)
    proc = spawn("worker", db_url, JOB_DELAY="60", STALE_AFTER="60", CONCURRENCY="2")
    try:
        wait_for(lambda: statuses(engine, "jobs") == {"running": 1})
        expire_leases(engine, "jobs")  # its lease runs out under the run: another worker's rescue takes it
        with engine.begin() as conn:
            assert [(i, st) for i, st, _ in eng.rescue(conn, JOBS, stale_after=timedelta(seconds=60))] == [
                (1, "queued")
            ]
        got = "SELECT status, lease_version, attempts FROM jobs WHERE id = 1"
        # claimed again by the process (lease 2) while its run goes on ...
        wait_for(lambda: tuple(scalar_row(engine, got))[:2] == ("running", 2), timeout=15)
        # ... and that claim's attempt given back (with the worker's next statement)
        with contextlib.suppress(AssertionError):
            wait_for(lambda: scalar_row(engine, got).attempts == 1, timeout=5)
    finally:
        proc.kill()
        proc.communicate(timeout=10)
    assert scalar(engine, "SELECT count(*) FROM job_calls") == 0  # its run never ended
    expire_leases(engine, "jobs")  # stale_after has passed since the kill
    from sa_outbox import Worker
    from sa_outbox.models import Job

    calls: list[int] = []
    w = Worker(engine, Job, {"record": lambda j: calls.append(j.attempts)}, stale_after=60, listen=False)
    w.run_once()  # the rescue puts it back
    w.run_once()  # and it runs
    w.close()
    with engine.connect() as conn:
        now = conn.execute(text("SELECT status, attempts, lease_version FROM jobs")).one()
    assert calls == [2]
    assert (now.status, now.attempts, now.lease_version) == ("done", 2, 3)


def test_cli_runs_an_async_dispatcher_target_and_stops_on_sigterm(side_tables: Engine, db_url: URL) -> None:
    engine = side_tables
    seed_events(engine, 20)
    env = dict(os.environ, DATABASE_URL=db_url.render_as_string(hide_password=False))
    proc = subprocess.Popen(
        [sys.executable, "-m", "sa_outbox", "dispatch", "tests.targets:async_dispatcher"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    wait_for(lambda: statuses(engine) == {"done": 20})
    code, out = stop(proc)
    assert code == 0, out
    assert scalar(engine, "SELECT count(DISTINCT message_id) FROM deliveries") == 20
    # the async loops log the signal as the sync ones do (they took it through stop() alone and never did)
    assert out.count("signal 15: finishing what is in hand, then stopping") == 1, out[-2000:]
