"""A claim sent ahead by an inline worker's own thread: the next batch's claim (with the outcomes due) goes out on
the loop's connection before short jobs in hand run, and is read after them — one round trip overlapped with
the jobs, with no hand-off to the claim thread.

What it must keep: the next batch is claimed while the jobs in hand still run; nothing else uses the
connection until the claim is read; a connection lost meanwhile loses no outcome and runs no job twice; a stop
gives the claimed rows back; a job in hand that runs long does not let those rows' leases expire (the heartbeat
reads the claim and renews them); a connection that cannot send ahead (no prepared statements) claims after
the jobs, as before; a statement found missing when the claim is read is prepared and sent again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from sqlalchemy import Connection, Engine, create_engine, text

from sa_outbox import ClaimedJob, Worker, _execute
from sa_outbox import _steps as eng
from sa_outbox._db import LoopConnection
from sa_outbox._worker import _SentAhead
from sa_outbox.models import Job

from .helpers import JOBS, row, seed_jobs, statuses


def _sent_ahead_unread(w: Worker) -> bool:
    inflight = w._inflight
    return inflight is not None and isinstance(inflight.future, _SentAhead) and not inflight.future.read


def _worker(engine: Engine, handler: Any, **kw: Any) -> Worker:
    return Worker(engine, Job, {"noop": handler}, listen=False, **kw)


def _unread_with_outcome(w: Worker, job_id: int) -> bool:
    """Whether ``w`` has a claim sent ahead, not read yet, that carries the outcome of job ``job_id``."""
    inflight = w._inflight
    return _sent_ahead_unread(w) and inflight is not None and job_id in {o.id for o in inflight.outcomes}


def _always_ahead(w: Worker) -> None:
    """Once a handler time is measured, every claim the loop sends beside a job goes out ahead on its own
    connection — never to the claim thread, and never left for after the batch. Which path a claim takes is
    otherwise decided by measured averages (a job that takes a lock on a slow machine lifts them past the
    hand-off line): the lock-wait tests need the claim sent ahead, every run."""
    pace = w._pace
    pace.claim_beside = lambda queued: None if pace.average is None else "ahead"  # type: ignore[method-assign]


def _side_lock(engine: Engine) -> tuple[Callable[[int], None], Callable[[], None], Callable[[], None]]:
    """A side transaction that locks job rows (``lock(id)``) until ``let_go()`` — or 20 s, so a failing test
    never leaves the loop waiting on the lock — and ``done()`` to end it. Warmed up: taking a lock in a job must
    stay short."""
    side = engine.connect()
    side_tx = side.begin()
    lock_row = text("SELECT 1 FROM jobs WHERE id = :id FOR UPDATE")
    side.execute(lock_row, {"id": 0})
    release = threading.Lock()

    def lock(job_id: int) -> None:
        side.execute(lock_row, {"id": job_id})

    def let_go() -> None:
        with release:
            if side_tx.is_active:
                side_tx.rollback()

    guard = threading.Timer(20, let_go)
    guard.start()

    def done() -> None:
        guard.cancel()
        let_go()
        side.close()

    return lock, let_go, done


def _stale_running(engine: Engine) -> list[int]:
    """Running jobs whose lease is older than 1 s (what a rescue with stale_after 1 s would take), by id."""
    with engine.connect() as probe:
        return list(
            probe.execute(
                text(
                    "SELECT id FROM jobs WHERE status = 'running' "
                    "AND locked_at < now() - interval '1 second' ORDER BY id"
                )
            ).scalars()
        )


def _drain(w: Worker) -> None:
    """Run ``w`` until nothing is left to claim or run, then close it."""
    try:
        w.run(install_signal_handlers=False, until_idle=True)
    finally:
        w.close()


def _no_claim_thread(w: Worker) -> list[int]:
    """Record every claim handed to the claim thread (there should be none behind no-op jobs)."""
    handed: list[int] = []
    submit = w._claimer.submit

    def spy(*args: Any) -> Any:
        handed.append(len(w._queue))
        return submit(*args)

    w._claimer.submit = spy  # type: ignore[method-assign]
    return handed


def test_the_next_batch_is_claimed_in_the_database_while_the_jobs_in_hand_still_run(engine: Engine) -> None:
    """Batches of 10 no-op jobs: while job 25 runs, the 10 jobs after the batch in hand are already claimed by
    this worker (before this change the next claim was sent only after the batch's last job)."""
    seed_jobs(engine, 60)
    seen: list[int] = []
    ahead_while_running: list[bool] = []
    claimed_beside: list[int] = []
    holder: list[Worker] = []

    def handler(job: ClaimedJob) -> None:
        seen.append(job.id)
        w = holder[0]
        ahead_while_running.append(_sent_ahead_unread(w))
        if job.id == 25:
            last_in_hand = job.id + len(w._queue)  # the rest of this batch waits in hand, in id order
            deadline = time.monotonic() + 5
            with engine.connect() as side:
                while time.monotonic() < deadline:
                    n = side.execute(
                        text(
                            "SELECT count(*) FROM jobs WHERE id > :last AND status = 'running' AND locked_by = :o"
                        ),
                        {"last": last_in_hand, "o": w.owner},
                    ).scalar_one()
                    side.rollback()
                    if n:
                        claimed_beside.append(n)
                        break
                    time.sleep(0.005)

    w = _worker(engine, handler, batch=10)
    holder.append(w)
    handed = _no_claim_thread(w)
    _drain(w)
    assert sorted(seen) == list(range(1, 61))  # each job once
    assert statuses(engine, "jobs") == {"done": 60}
    assert claimed_beside == [10], claimed_beside  # batch 4 claimed while job 25 ran
    # no hand-off to the claim thread, but after job 25 (which took a while) and a job or two the machine slowed
    assert len(handed) <= 3, handed
    # after the first batch (no handler duration measured yet), jobs ran with the next claim in flight: most
    # of them (without claims sent ahead: none). Job 25's long wait lifts the handlers' moving average, so a
    # few jobs after it run before the next claim is sent; on a loaded machine (the full suite on 2 cores
    # beside another load) 30 of these 50 did, 45-50 on a quiet one.
    assert sum(ahead_while_running[10:]) >= 25, ahead_while_running


def test_a_connection_lost_while_a_claim_sent_ahead_waits_loses_no_outcome_and_runs_no_job_twice(
    engine: Engine,
) -> None:
    """Job 4 locks its own row from a side transaction: the claim sent ahead that carries job 4's outcome waits
    on that lock. A later job, seeing that claim unread and its backend waiting on the lock, kills the backend:
    nothing of the statement committed. The loop reads the error after the jobs in hand, reconnects, and writes
    every outcome with its next claim; no job runs twice, none is lost."""
    seed_jobs(engine, 15)
    seen: list[int] = []
    killed: list[int] = []
    holder: list[Worker] = []
    lock, let_go, done = _side_lock(engine)

    def handler(job: ClaimedJob) -> None:
        seen.append(job.id)
        w = holder[0]
        if job.id == 4:
            lock(4)
        elif not killed and _sent_ahead_unread(w) and 4 in {o.id for o in w._inflight.outcomes}:  # type: ignore[union-attr]
            conn = w._db._conn
            assert conn is not None
            pid = conn.connection.driver_connection.info.backend_pid
            with engine.connect() as killer:
                deadline = time.monotonic() + 0.5
                while time.monotonic() < deadline:
                    waiting = killer.execute(
                        text("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :p"),
                        {"p": pid},
                    ).scalar()
                    killer.rollback()
                    if waiting:
                        killer.execute(text("SELECT pg_terminate_backend(:p, 5000)"), {"p": pid})
                        killer.commit()
                        killed.append(job.id)
                        let_go()
                        break
                    time.sleep(0.005)

    w = _worker(engine, handler, batch=2)
    _always_ahead(w)
    holder.append(w)
    try:
        w.run(install_signal_handlers=False, until_idle=True)
    finally:
        w.close()
        done()
    assert len(killed) == 1, killed  # a claim sent ahead was waiting, unread, when its backend was killed
    assert sorted(seen) == list(range(1, 16))  # no job twice, none lost
    assert statuses(engine, "jobs") == {"done": 15}
    assert w.stats.db_errors >= 1 and w.stats.lost_leases == 0
    for i in range(1, 16):
        assert row(engine, "jobs", i).lease_version == 1  # claimed once each


def test_a_stop_while_a_claim_sent_ahead_is_unread_gives_its_rows_back(engine: Engine) -> None:
    seed_jobs(engine, 20)
    seen: list[int] = []
    unread_at_stop: list[bool] = []
    holder: list[Worker] = []

    def handler(job: ClaimedJob) -> None:
        seen.append(job.id)
        if job.id == 8:
            unread_at_stop.append(_sent_ahead_unread(holder[0]))
            holder[0].stop()

    w = _worker(engine, handler, batch=5)
    _always_ahead(w)  # (which path a claim takes otherwise rests on measured times: under load, not ahead)
    holder.append(w)
    try:
        w.run(install_signal_handlers=False)
    finally:
        w.close()
    assert unread_at_stop == [True]
    assert seen == list(range(1, 9))
    st = statuses(engine, "jobs")
    assert st == {"done": 8, "queued": 12}, st
    for i in range(9, 21):  # claimed ahead or not, given back unstarted with the attempt refunded
        r = row(engine, "jobs", i)
        assert (r.status, r.attempts, r.locked_by) == ("queued", 0, None), r


def test_a_long_job_in_hand_does_not_let_the_leases_of_a_claim_sent_ahead_expire(engine: Engine) -> None:
    """Jobs 1–2 are no-ops, so the claim of 6–10 goes out ahead at job 2; job 3 then runs 1.6 s with
    stale_after 1 s. The heartbeat reads the claim and renews those rows: at 1.3 s none of the worker's running
    rows is older than stale_after (what the reaper of any other worker would take), and nothing is claimed
    twice."""
    seed_jobs(engine, 10)
    seen: list[int] = []
    stale_seen: list[list[int]] = []
    unread_at_start: list[bool] = []
    holder: list[Worker] = []

    def handler(job: ClaimedJob) -> None:
        seen.append(job.id)
        if job.id == 3:
            unread_at_start.append(_sent_ahead_unread(holder[0]))
            started = time.monotonic()
            time.sleep(1.3)
            stale_seen.append(_stale_running(engine))
            time.sleep(max(0.0, 1.6 - (time.monotonic() - started)))

    w = _worker(engine, handler, batch=5, stale_after=1.0, heartbeat=0.2)
    holder.append(w)
    _drain(w)
    assert unread_at_start == [True]
    assert stale_seen == [[]], stale_seen
    assert sorted(seen) == list(range(1, 11))
    assert statuses(engine, "jobs") == {"done": 10}
    assert w.stats.lost_leases == 0 and w.stats.rescued == 0
    for i in range(1, 11):
        assert row(engine, "jobs", i).lease_version == 1


def test_a_claim_sent_ahead_that_waits_on_a_lock_does_not_stop_the_heartbeat(engine: Engine) -> None:
    """Job 3 locks its own row from a side transaction, so the next claim sent ahead (carrying job 3's outcome)
    waits on that lock; the first job to run while it does takes 1.6 s, with stale_after 1 s. The heartbeat
    must not wait for that claim: it renews the jobs in hand meanwhile, so at 1.3 s none of them is older than
    stale_after (but for the rows of the claim's own outcomes). Then the lock goes, the claim lands, and every job runs once."""
    seed_jobs(engine, 15)
    seen: list[int] = []
    stale_seen: list[list[int]] = []
    waiting_seen: list[int] = []
    holder: list[Worker] = []
    lock, let_go, done = _side_lock(engine)

    def handler(job: ClaimedJob) -> None:
        seen.append(job.id)
        if job.id == 3:
            lock(3)
        elif not waiting_seen and _unread_with_outcome(holder[0], 3):
            started = time.monotonic()
            waiting_seen.append(job.id)
            time.sleep(1.3)
            stale = _stale_running(engine)
            inflight = holder[0]._inflight
            assert inflight is not None
            # (the rows of the claim's own outcomes are locked by it or by the side transaction: no
            # heartbeat can renew those, and no rescue can take them either)
            stale_seen.append(sorted(set(stale) - {o.id for o in inflight.outcomes}))
            let_go()
            time.sleep(max(0.0, 1.6 - (time.monotonic() - started)))

    w = _worker(engine, handler, batch=2, stale_after=1.0, heartbeat=0.2)
    _always_ahead(w)
    holder.append(w)
    try:
        _drain(w)
    finally:
        done()
    assert len(waiting_seen) == 1  # a job ran long while the claim with job 3's outcome was out, unread
    assert stale_seen == [[]], stale_seen
    assert sorted(seen) == list(range(1, 16))
    assert statuses(engine, "jobs") == {"done": 15}
    assert w.stats.lost_leases == 0
    for i in range(1, 16):
        assert row(engine, "jobs", i).lease_version == 1


def test_a_connection_without_prepared_statements_claims_after_the_jobs_as_before(engine: Engine) -> None:
    """``prepare_threshold=None`` (PgBouncer in transaction mode without prepared statements): nothing can be
    sent ahead; the worker learns it at its first try and claims after each batch, on its own thread."""
    e = create_engine(engine.url, connect_args={"prepare_threshold": None})
    seed_jobs(e, 30)
    seen: list[int] = []
    ahead: list[bool] = []
    holder: list[Worker] = []

    def handler(job: ClaimedJob) -> None:
        seen.append(job.id)
        ahead.append(_sent_ahead_unread(holder[0]))

    w = _worker(e, handler, batch=5)
    holder.append(w)
    handed = _no_claim_thread(w)
    try:
        _drain(w)
    finally:
        e.dispose()
    assert sorted(seen) == list(range(1, 31))
    assert statuses(engine, "jobs") == {"done": 30}
    assert not any(ahead) and handed == [] and w._sends_ahead is False


@pytest.fixture
def one_connection(engine: Engine) -> Any:
    e = create_engine(engine.url, pool_size=1, max_overflow=0)
    yield e
    e.dispose()


def test_a_claim_sent_ahead_whose_statement_went_missing_is_prepared_and_sent_again(
    one_connection: Engine,
) -> None:
    """DEALLOCATE ALL between two sends (psycopg's own, on a rollback): the second send goes out under the
    name the session no longer has; reading it finds the statement missing (nothing ran), prepares it again
    and sends it once more — the same rows as a claim run at once."""
    seed_jobs(one_connection, 4)
    loop = LoopConnection(one_connection, "jobs")

    def send(c: Connection) -> Any:
        reader = eng.send_claim(c, JOBS, [], owner="w", batch=1, queue="default")
        assert reader is not None
        return reader

    first = loop.run(send)
    assert [r[0] for r in loop.run(lambda c: first()[1])] == [1]
    with loop.use() as conn:
        driver = conn.connection.driver_connection
        assert isinstance(driver, psycopg.Connection)
        driver.execute("DEALLOCATE ALL")
        assert not [
            n
            for (n,) in conn.exec_driver_sql("SELECT name FROM pg_prepared_statements")
            if n.startswith(_execute._NAME_PREFIX)
        ]
    second = loop.run(send)
    applied, rows = loop.run(lambda c: second())
    assert applied == set() and [r[0] for r in rows] == [2]
    # with outcomes: finalize and claim in one statement, read later
    done = eng.done_outcome(1, 1, "done")
    third = loop.run(lambda c: eng.send_claim(c, JOBS, [done], owner="w", batch=1, queue="default"))
    assert third is not None
    applied, rows = loop.run(lambda c: third())
    loop.drop()
    assert applied == {1} and [r[0] for r in rows] == [3]
    assert statuses(one_connection, "jobs") == {"done": 1, "running": 2, "queued": 1}


def test_a_claim_is_not_sent_ahead_inside_a_transaction_block(one_connection: Engine) -> None:
    """Inside BEGIN … COMMIT a missing statement could not be retried: such a connection never sends ahead."""
    loop = LoopConnection(one_connection, "jobs")
    with loop.use() as conn, _execute.transaction(conn):
        assert eng.send_claim(conn, JOBS, [], owner="w", batch=1, queue="default") is None
    loop.drop()


def test_heartbeat_and_loop_read_a_claim_sent_ahead_once(engine: Engine) -> None:
    """Two threads asking for a claim sent ahead at once: one reads it, the other gets the same value."""
    calls: list[int] = []
    gate = threading.Event()

    def reader() -> tuple[set[int], list[Any]]:
        calls.append(1)
        gate.wait(2)
        return {1}, [(7,)]

    sent = _SentAhead(reader)
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(sent.result()))
    t.start()
    time.sleep(0.05)
    assert not sent.read  # the connection is still the claim's
    gate.set()
    got.append(sent.result())
    t.join(5)
    assert calls == [1] and got == [({1}, [(7,)]), ({1}, [(7,)])] and sent.read
