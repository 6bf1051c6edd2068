"""The jobs worker: the jobs document's scenarios, fencing, reaping, FK locks, wake-ups."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import Pool

from sa_outbox import (
    AsyncWorker,
    ClaimedJob,
    ConfigurationError,
    Defer,
    PermanentError,
    RetryableError,
    TaskRegistry,
    Worker,
    _worker,
    cancel_jobs,
    enqueue,
)
from sa_outbox import _steps as eng
from sa_outbox._worker import TRIP_GUESS, _Pace
from sa_outbox.admin import retry_dead, skip_dead
from sa_outbox.models import Job, OutboxEvent
from sa_outbox.testing import RecordingPublisher, drain

from .factories import FAST, expire_leases
from .helpers import (
    JOBS,
    OUTBOX,
    claim_forms_sent,
    claim_jobs,
    row,
    seed_events,
    seed_jobs,
    statuses,
    wait_for_lock_wait,
)
from .test_loop_guarantees import wait_until


def worker(engine: Engine, handlers: dict[str, Any], **kw: Any) -> Worker:
    kw.setdefault("listen", False)
    return Worker(engine, Job, handlers, **kw)


def test_successful_job_is_done_with_finished_at(engine: Engine) -> None:
    seed_jobs(engine, 3)
    calls: list[int] = []
    w = worker(engine, {"noop": lambda job: calls.append(job.id)})
    assert drain(w) == 3
    assert sorted(calls) == [1, 2, 3]
    r = row(engine, "jobs", 1)
    assert (r.status, r.attempts, r.locked_by, r.locked_at, r.finished_at is not None) == (
        "done",
        1,
        None,
        None,
        True,
    )


def test_documents_ten_job_scenario_two_workers_one_always_failing(engine: Engine) -> None:
    """10 jobs, 2 workers, job 7 always fails with max_attempts=3 (the jobs design's default; the library's is
    10): retried after ~2 s and ~4 s, then failed."""
    seed_jobs(engine, 10, max_attempts=3)
    calls: dict[int, list[float]] = {}
    lock = threading.Lock()

    def handle(job: ClaimedJob) -> None:
        with lock:
            calls.setdefault(job.id, []).append(time.monotonic())
        if job.payload["n"] == 6:  # the 7th job
            raise RuntimeError(f"n={job.payload['n']} always fails")

    ws = [worker(engine, {"noop": handle}, poll_interval=0.1) for _ in range(2)]
    threads = [threading.Thread(target=w.run, kwargs={"install_signal_handlers": False}) for w in ws]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and statuses(engine, "jobs").get("failed", 0) == 0:
        time.sleep(0.1)
    for w in ws:
        w.stop()
    for t in threads:
        t.join(10)
    assert statuses(engine, "jobs") == {"done": 9, "failed": 1}
    failed = row(engine, "jobs", 7)
    assert failed.attempts == 3 and "RuntimeError: n=6 always fails" in failed.last_error
    assert all(len(v) == 1 for k, v in calls.items() if k != 7)
    gaps = [b - a for a, b in zip(calls[7], calls[7][1:], strict=False)]
    assert len(gaps) == 2
    assert 1.8 <= gaps[0] <= 3.5 and 3.8 <= gaps[1] <= 5.5, gaps  # 2^1 s, 2^2 s (database clock)


def test_failure_classes_for_jobs(engine: Engine) -> None:
    seed_jobs(engine, 1, task="defer")
    seed_jobs(engine, 1, task="perm")
    seed_jobs(engine, 1, task="retry")
    seed_jobs(engine, 1, task="unknown-task")

    def defer(job: ClaimedJob) -> None:
        raise Defer(timedelta(seconds=120), "waiting for payment")

    def perm(job: ClaimedJob) -> None:
        raise PermanentError("bad address")

    def retry(job: ClaimedJob) -> None:
        raise RetryableError("smtp 451")

    w = worker(engine, {"defer": defer, "perm": perm, "retry": retry}, backoff=FAST, unknown_task_grace=0)
    assert w.run_once() == 4
    with engine.connect() as conn:
        rows = {
            r.task: r
            for r in conn.execute(
                text(
                    "SELECT task, status, attempts, last_error, extract(epoch FROM run_at - now()) AS wait FROM jobs"
                )
            )
        }
    assert (rows["defer"].status, rows["defer"].attempts) == ("queued", 0) and float(rows["defer"].wait) > 100
    assert (rows["perm"].status, rows["perm"].last_error) == ("failed", "PermanentError: bad address")
    assert (rows["retry"].status, rows["retry"].attempts) == ("queued", 1)
    assert rows["unknown-task"].status == "failed"
    assert "no handler registered for task 'unknown-task'" in rows["unknown-task"].last_error


def test_an_error_text_with_nul_and_array_syntax_is_recorded_not_a_worker_crash(engine: Engine) -> None:
    """PostgreSQL text cannot hold NUL: an exception message with one made every finalize of the batch fail,
    so the worker died and the job, still leased, came back to kill the next one. The error is recorded with
    the NUL written as ``\\x00``; quotes, backslashes and braces (array-literal syntax) arrive unchanged."""
    seed_jobs(engine, 2, task="bad", max_attempts=1)
    seed_jobs(engine, 1, task="noop")
    message = 'bad\x00byte "q" \\ {a,b} NULL'

    def bad(job: ClaimedJob) -> None:
        raise ValueError(message)

    w = worker(engine, {"bad": bad, "noop": lambda job: None}, backoff=FAST)
    assert drain(w) == 3
    assert statuses(engine, "jobs") == {"failed": 2, "done": 1}
    expected = "retries exhausted (1/1): ValueError: " + message.replace("\x00", "\\x00")
    assert {row(engine, "jobs", i).last_error for i in (1, 2)} == {expected}


def test_decorator_registry(engine: Engine) -> None:
    tasks = TaskRegistry()
    seen: list[str] = []

    @tasks.task("hello")
    def hello(job: ClaimedJob) -> None:
        seen.append(job.payload["who"])

    w = worker(engine, tasks)

    @w.task()
    def bye(job: ClaimedJob) -> None:
        seen.append("bye")

    with Session(engine) as s, s.begin():
        enqueue(s, Job, "hello", {"who": "world"}, registry=w.handlers)
        enqueue(s, Job, "bye", {}, registry=w.handlers)
    drain(w)
    assert sorted(seen) == ["bye", "world"]


def test_stale_worker_cannot_finalize_a_reaped_and_reclaimed_job(engine: Engine) -> None:
    """`AND status = 'running'` is not enough: after reaping and re-claiming, the job is running again."""
    seed_jobs(engine, 1)
    with engine.begin() as conn:
        [a] = claim_jobs(conn, "A")
    expire_leases(engine, "jobs")  # A stalled past stale_after
    with engine.begin() as conn:
        eng.rescue(conn, JOBS, stale_after=timedelta(seconds=0.2))
        [b] = claim_jobs(conn, "B")
    assert b.id == a.id and b.lease_version == a.lease_version + 1
    assert row(engine, "jobs", 1).status == "running"
    with engine.begin() as conn:
        assert (
            eng.finalize(conn, JOBS, [eng.Outcome(a.id, a.lease_version, "failed", error="A late")]) == set()
        )
        assert eng.finalize(conn, JOBS, [eng.Outcome(b.id, b.lease_version, "done")]) == {b.id}
    r = row(engine, "jobs", 1)
    assert (
        (r.status, r.attempts) == ("done", 2) and "lease expired (owner A" in (r.last_error or "")
    ) or r.status == "done"


_OUTCOME_KINDS: dict[str, Any] = {
    "done with a result": lambda spec, i, v: eng.done_outcome(i, v, spec.done, '{"ok": [1, "é"]}'),
    "done": lambda spec, i, v: eng.done_outcome(i, v, spec.done),
    "retry after 90 s": lambda spec, i, v: eng.Outcome(i, v, spec.ready, delay=90.0, error="boom\nline 2"),
    "dead": lambda spec, i, v: eng.Outcome(i, v, spec.dead, error="NUL \x00 here " + "x" * 5000),
    "released": lambda spec, i, v: eng.release(spec, i, v, "shutting down"),
    "cancelled": lambda spec, i, v: eng.cancelled(spec, i, v, "by operator"),
}


@pytest.mark.parametrize(
    ("table", "kind"),
    [(t, k) for t in ("jobs", "outbox") for k in sorted(_OUTCOME_KINDS) if (t, k) != ("outbox", "cancelled")],
)
def test_one_outcome_alone_writes_what_it_writes_in_a_batch(engine: Engine, table: str, kind: str) -> None:
    """A statement with exactly one outcome takes its own form (plain parameters, no unnest): each kind of
    outcome written alone leaves its row exactly as the batch form leaves a twin row — status, due time,
    attempts, error, finish time, result, lease — and a stale lease version is fenced out by both."""
    spec = JOBS if table == "jobs" else OUTBOX
    if table == "jobs":
        seed_jobs(engine, 3)
        with engine.begin() as conn:
            conn.execute(text("UPDATE jobs SET cancel_requested_at = now() WHERE id = 3"))
    else:
        seed_events(engine, 3)
    with engine.begin() as conn:
        if table == "jobs":
            held = [(j.id, j.lease_version) for j in claim_jobs(conn, "w", batch=3)]
        else:
            held = [
                (r[0], r[1]) for r in eng.claim(conn, OUTBOX, owner="w", batch=3, lease=timedelta(seconds=60))
            ]
    (a, va), (b, vb), (c, vc) = sorted(held)
    make = _OUTCOME_KINDS[kind]
    with engine.begin() as conn:  # the one-outcome form, and a stale version fenced out by it
        assert eng.finalize(conn, spec, [make(spec, a, va + 1)]) == set()
        assert eng.finalize(conn, spec, [make(spec, a, va)]) == {a}
    with engine.begin() as conn:  # the batch form: b as a twin of a, c beside it
        assert eng.finalize(conn, spec, [make(spec, b, vb), make(spec, c, vc)]) == {b, c}
    skip = {"id", "payload", "aggregate_id", "created_at", "available_at", "run_at", "finished_at", "done_at"}
    ra, rb = row(engine, table, a), row(engine, table, b)
    assert {k: v for k, v in ra._mapping.items() if k not in skip} == {
        k: v for k, v in rb._mapping.items() if k not in skip
    }
    due = spec.due.name
    with engine.connect() as conn:  # the times: set (or kept) alike, each from its own statement's now()
        times = conn.execute(
            text(
                f"SELECT id, {due} - created_at AS wait, {spec.finished.name} IS NULL AS open "
                f"FROM {table} WHERE id IN (:a, :b) ORDER BY id"
            ),
            {"a": a, "b": b},
        ).all()
    assert times[0].open == times[1].open, times
    assert abs((times[0].wait - times[1].wait).total_seconds()) < 30, times  # 90 s delay vs kept: apart
    if kind == "retry after 90 s":
        assert times[0].wait.total_seconds() > 80, times
    if kind == "released":
        assert (ra.status, ra.attempts, ra.lease_owner if table == "outbox" else ra.locked_by) == (
            spec.ready,
            0,
            None,
        )
    if table == "jobs" and kind == "retry after 90 s":  # a retry of a job whose cancellation was asked
        assert row(engine, "jobs", c).status == "cancelled"


def test_reaper_fails_a_stale_job_out_of_attempts_and_appends_the_reason(engine: Engine) -> None:
    seed_jobs(engine, 1, max_attempts=1)
    with engine.begin() as conn:
        claim_jobs(conn, "crashed")
    expire_leases(engine, "jobs")
    w = worker(engine, {"noop": lambda j: None}, stale_after=0.1)
    assert w.run_once() == 0
    r = row(engine, "jobs", 1)
    assert r.status == "failed" and r.finished_at is not None
    assert "lease expired (owner crashed, lease_version 1) after max attempts" in r.last_error


@pytest.mark.parametrize("kind", ["jobs", "outbox"])
def test_a_lease_taken_by_a_statement_that_waited_on_a_lock_starts_when_the_row_is_claimed(
    engine: Engine, kind: str
) -> None:
    """A finalize-and-claim whose finalize waits on a row lock (a user's transaction holding a job row FOR
    UPDATE) claims its next rows after the wait: their lease must start then, not when the statement
    started. Stamped with the statement's now(), rows claimed after a wait longer than stale_after were born
    expired, and any rescue — the worker's own, a second later — took back jobs the worker then ran: twice."""
    spec, table = (JOBS, "jobs") if kind == "jobs" else (OUTBOX, "outbox")
    lease = timedelta(seconds=30)
    if kind == "jobs":
        seed_jobs(engine, 2)
    else:
        seed_events(engine, 2)
    queue = "default" if kind == "jobs" else None
    with engine.begin() as conn:
        [first] = eng.claim(conn, spec, owner="w", batch=1, lease=lease, queue=queue)
    version = row(engine, table, first[0]).lease_version
    side = engine.connect()
    side_tx = side.begin()
    side.execute(text(f"SELECT 1 FROM {table} WHERE id = 1 FOR UPDATE"))
    got: list[tuple[set[int], list[Any]]] = []
    pid: list[int] = []

    def finalize_and_claim() -> None:
        with engine.begin() as conn:
            pid.append(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())
            outcome = eng.Outcome(first[0], version, "done")
            got.append(
                eng.finalize_and_claim(conn, spec, [outcome], owner="w", batch=1, lease=lease, queue=queue)
            )

    t = threading.Thread(target=finalize_and_claim)
    t.start()
    try:
        assert wait_for_lock_wait(engine, lambda: pid[0] if pid else None)  # the finalize waits on the lock
        time.sleep(1.2)
    finally:
        side_tx.rollback()
        side.close()
        t.join(10)
    [(applied, claimed)] = got
    assert applied == {1} and [r[0] for r in claimed] == [2]
    with engine.connect() as conn:
        if kind == "jobs":
            age = conn.execute(
                text("SELECT extract(epoch FROM clock_timestamp() - locked_at) FROM jobs WHERE id = 2")
            )
            assert age.scalar_one() < 0.6  # not the 1.2 s the statement waited
        else:
            left = conn.execute(
                text("SELECT extract(epoch FROM lease_until - clock_timestamp()) FROM outbox WHERE id = 2")
            )
            assert left.scalar_one() > 30 - 0.6


def test_a_worker_whose_claim_waited_on_a_lock_past_stale_after_runs_no_job_twice(engine: Engine) -> None:
    """Job 3's row is held FOR UPDATE by a user's transaction for 1.5 s (stale_after 1 s): the claim that
    carries job 3's outcome waits that long. The rows it claims get their lease when they are written, after
    the wait, so the worker's own rescue a moment later does not take them back while it runs them."""
    seed_jobs(engine, 20)
    seen: list[int] = []
    side = engine.connect()
    side_tx = side.begin()

    def handler(job: ClaimedJob) -> None:
        seen.append(job.id)
        if job.id == 3:
            side.execute(text("SELECT 1 FROM jobs WHERE id = 3 FOR UPDATE"))
            threading.Timer(1.5, side_tx.rollback).start()

    w = worker(engine, {"noop": handler}, batch=5, stale_after=1.0, heartbeat=0.2)
    try:
        w.run(install_signal_handlers=False, until_idle=True)
    finally:
        w.close()
        time.sleep(0.1 if not side_tx.is_active else 1.6)
        side.close()
    assert sorted(seen) == list(range(1, 21)), sorted(seen)  # none twice, none lost
    assert statuses(engine, "jobs") == {"done": 20}
    assert w.stats.rescued == 0 and w.stats.lost_leases == 0


def test_heartbeat_keeps_a_long_job_from_being_reaped(engine: Engine) -> None:
    seed_jobs(engine, 1, task="slow")
    other = worker(engine, {}, stale_after=1.0)

    def slow(job: ClaimedJob) -> None:
        for _ in range(15):  # 3 s, three times stale_after
            time.sleep(0.2)
            other.run_once()  # another worker's reaper runs meanwhile

    # Ten beats per stale_after: a loaded CI box once let 0.4 s pass between beats with four per window.
    w = worker(engine, {"slow": slow}, stale_after=1.0, heartbeat=0.1)
    assert w.run_once() == 1
    r = row(engine, "jobs", 1)
    assert (r.status, r.attempts, r.lease_version) == ("done", 1, 1)
    assert w.stats.lost_leases == 0


def test_a_lost_lease_is_reported_by_the_second_beat_that_cannot_renew_it(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """One beat that cannot renew a job may have raced the job's own finalize (committed, not yet released),
    or met a transaction holding its row: no warning — a lease guard looks at the row. The guard finds it no
    longer ours, and the next beat that cannot renew it warns, once."""
    seed_jobs(engine, 1, task="held")
    inside, release = threading.Event(), threading.Event()

    def held(job: ClaimedJob) -> None:
        inside.set()
        release.wait(10)

    w = worker(engine, {"held": held})
    t = threading.Thread(target=w.run_once)
    t.start()
    try:
        assert inside.wait(10)
        with engine.begin() as conn:  # another worker reaped and re-claimed it
            conn.execute(text("UPDATE jobs SET lease_version = lease_version + 1 WHERE id = 1"))
        w.beat_once()
        assert not [r for r in caplog.records if "no longer ours" in r.getMessage()]
        deadline = time.monotonic() + 10
        while w._guarding and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not w._guarding and w._unguardable == {(1, 1)}
        w.beat_once()
        w.beat_once()
        lost = [r for r in caplog.records if "no longer ours" in r.getMessage()]
        assert len(lost) == 1 and "job 1 version 1" in lost[0].getMessage()
    finally:
        release.set()
        t.join(10)


def test_a_beat_never_waits_for_a_row_lock_and_so_cannot_deadlock_with_a_finalize(engine: Engine) -> None:
    """The heartbeat skips rows locked right now (SKIP LOCKED) instead of waiting: it used to wait, and the
    worker's own finalize writing the same rows in another order deadlocked with it (the 1M-job memory run)."""
    seed_jobs(engine, 2, task="held")
    inside, release = threading.Event(), threading.Event()

    def held(job: ClaimedJob) -> None:
        inside.set()
        release.wait(10)

    w = worker(engine, {"held": held}, concurrency=2)
    t = threading.Thread(target=w.run_once)
    t.start()
    locker = engine.connect()
    try:
        assert inside.wait(10)
        locker.begin()
        locker.execute(text("SELECT id FROM jobs WHERE id = 1 FOR UPDATE"))  # as a finalize in flight would
        with engine.connect() as conn:
            before = dict(conn.execute(text("SELECT id, locked_at FROM jobs")).all())
        beat = threading.Thread(target=w.beat_once)
        beat.start()
        beat.join(10)
        assert not beat.is_alive(), "the beat waited for the row lock"
        with engine.connect() as conn:
            after = dict(conn.execute(text("SELECT id, locked_at FROM jobs")).all())
        assert after[1] == before[1] and after[2] > before[2]  # the locked row is left for the next beat
    finally:
        locker.rollback()
        locker.close()
        release.set()
        t.join(10)


@contextlib.contextmanager
def _worker_running(
    db_url: Any,
    async_url: Any,
    flavour: str,
    make_handler: Any,
    pool: dict[str, Any],
    release: Any,
    **kw: Any,
) -> Any:
    """A Worker or an AsyncWorker (``flavour``) on an engine of its own (``pool``), its ``run_once`` on a
    thread; the task ``held`` runs ``make_handler(that engine)``. Yields a list that holds the worker once it
    exists; at the end, sets ``release`` and joins the thread."""
    workers: list[Any] = []
    if flavour == "sync":
        wengine = create_engine(db_url, **pool)
        w = Worker(wengine, Job, {"held": make_handler(wengine)}, listen=False, **kw)
        workers.append(w)
        target: Any = w.run_once
    else:

        def target() -> None:
            async def go() -> None:
                aengine = create_async_engine(async_url, **pool)
                aw = AsyncWorker(aengine, Job, {"held": make_handler(aengine)}, listen=False, **kw)
                workers.append(aw)
                try:
                    await aw.run_once()
                finally:
                    await aw.close()
                    await aengine.dispose()

            asyncio.run(go())

    t = threading.Thread(target=target)
    t.start()
    try:
        yield workers
    finally:
        release.set()
        t.join(30)
        if flavour == "sync":
            wengine.dispose()
    assert not t.is_alive()


@contextlib.contextmanager
def _held_jobs_running(engine: Engine, db_url: Any, async_url: Any, flavour: str, jobs: int) -> Any:
    """A worker (``flavour``), stale_after 1 s, beating every 0.2 s, on an engine of three connections (loop,
    heartbeat, guards), running ``jobs`` seeded jobs at once, each until the block ends. After the block,
    every job ran once, on its first lease, and its outcome was applied."""
    seed_jobs(engine, jobs, task="held")
    started, release = threading.Semaphore(0), threading.Event()
    calls: list[int] = []

    def held(job: ClaimedJob) -> None:
        calls.append(job.id)
        started.release()
        release.wait(20)

    kw: dict[str, Any] = {"stale_after": 1.0, "heartbeat": 0.2, "concurrency": jobs, "batch": jobs}
    pool: dict[str, Any] = {"pool_size": 3, "max_overflow": 0, "pool_timeout": 5}
    with _worker_running(db_url, async_url, flavour, lambda _e: held, pool, release, **kw) as workers:
        for _ in range(jobs):
            assert started.acquire(timeout=20)
        yield
    assert statuses(engine, "jobs") == {"done": jobs}
    with engine.connect() as conn:
        assert conn.execute(text("SELECT max(attempts), max(lease_version) FROM jobs")).one() == (1, 1)
    assert sorted(calls) == list(range(1, jobs + 1))
    assert workers[0].stats.lost_leases == 0


@pytest.mark.parametrize(
    ("flavour", "jobs"),
    [("sync", 1), ("async", 1), ("sync", 40), ("async", 40), ("sync", 300), ("async", 300)],
)
def test_a_job_whose_row_a_transaction_held_past_stale_after_is_not_rescued_the_moment_it_is_released(
    db_url: Any, engine: Engine, async_url: Any, flavour: str, jobs: int
) -> None:
    """A transaction holds running jobs' rows FOR UPDATE for twice stale_after: no beat can renew their
    leases meanwhile (they skip locked rows). A rescue sent the moment it commits, before any beat could
    come, finds nothing to take: at its first skip the heartbeat took the jobs' guards, which the rescue
    respects, and renews the rows as soon as they are free. Each job runs once, on its first lease, and its
    outcome is applied (the reviewer's script ran one on two workers 3 times out of 3). Forty rows held at
    once with the worker's pool at three connections (loop, heartbeat, guards): one connection holds every
    guard (one per guard ran 27 of 40 jobs twice with the default pool). Three hundred: more than the guard
    transaction's rotation size (GUARD_ROTATE), which must not let go of guards still wanted (a reviewer's
    script had all 300 rescued)."""
    with (
        _held_jobs_running(engine, db_url, async_url, flavour, jobs),
        engine.connect() as locker,
        engine.connect() as rescuer,
    ):
        locker.begin()
        locker.execute(text("SELECT id FROM jobs FOR UPDATE"))
        time.sleep(2.0)
        expired = rescuer.execute(text("SELECT count(*) FROM jobs WHERE locked_at < now() - interval '1 s'"))
        assert expired.scalar() == jobs, "the leases should have run out while the rows were held"
        rescuer.rollback()
        locker.commit()
        taken = eng.rescue(rescuer, JOBS, stale_after=timedelta(seconds=1))
        rescuer.commit()
        assert taken == []


def _guards_held(conn: Any) -> set[int]:
    """The ids whose lease guard some session holds (the two-int4 advisory locks of guard_statement)."""
    rows = conn.execute(
        text(
            "SELECT objid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 AND granted "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
    ).scalars()
    ids = {int(r) for r in rows}
    conn.rollback()
    return ids


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_the_guard_transaction_rotates_out_the_guards_it_no_longer_needs_and_keeps_the_wanted_ones(
    db_url: Any, engine: Engine, async_url: Any, flavour: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guards are transaction-scoped advisory locks, let go of all at once. Once more than GUARD_ROTATE of
    them guard rows already renewed, the guard transaction ends to shed them and takes the guards still wanted
    again in the next one (at once, in the same round: the gap is one round trip). Four of six held rows freed
    (rotation size 2 here): the four guards go, the other two rows' stay, and a rescue the moment their holder
    commits takes nothing. Before, the rotation counted every guard taken, wanted or not (300 held rows were
    all let go of and rescued), and a guard transaction that never rotated would keep the four."""
    monkeypatch.setattr(_worker, "GUARD_ROTATE", 2)
    with (
        _held_jobs_running(engine, db_url, async_url, flavour, 6),
        engine.connect() as first,
        engine.connect() as second,
        engine.connect() as rescuer,
    ):
        first.begin()
        first.execute(text("SELECT id FROM jobs WHERE id <= 4 FOR UPDATE"))
        second.begin()
        second.execute(text("SELECT id FROM jobs WHERE id > 4 FOR UPDATE"))
        time.sleep(2.0)
        assert _guards_held(rescuer) == {1, 2, 3, 4, 5, 6}
        first.commit()  # rows 1-4 renewed next round: four guards no longer needed, more than 2
        deadline = time.monotonic() + 5
        while _guards_held(rescuer) != {5, 6} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _guards_held(rescuer) == {5, 6}, "the guard transaction kept its done guards (or lost 5, 6)"
        second.commit()
        taken = eng.rescue(rescuer, JOBS, stale_after=timedelta(seconds=1))
        rescuer.commit()
        assert taken == []


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_guard_that_finds_the_pool_full_does_not_hold_up_the_other_jobs_beats(
    db_url: Any, engine: Engine, async_url: Any, flavour: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The guard connection is opened at the first held row. With the worker's pool full (its loop, its
    heartbeat and two handlers that each keep a connection), waiting for a checkout (pool_timeout, 8 s) held
    up the heartbeat, and every running job's lease ran out with the held one's: a rescue at the release took
    both (a reviewer's script). Now the round goes on without a guard, warned once: the other job keeps its
    lease; only the held job is as exposed as it was before guards existed."""
    seed_jobs(engine, 2, task="held")
    started, release = threading.Semaphore(0), threading.Event()

    def make_handler(wengine: Any) -> Any:
        if flavour == "sync":

            def held(job: ClaimedJob) -> None:
                with wengine.connect() as c:  # the handler's own work keeps a connection of the worker's pool
                    c.execute(text("SELECT 1"))
                    started.release()
                    release.wait(20)

            return held

        async def aheld(job: ClaimedJob) -> None:
            async with wengine.connect() as c:
                await c.execute(text("SELECT 1"))
                started.release()
                while not release.is_set():
                    await asyncio.sleep(0.02)

        return aheld

    pool: dict[str, Any] = {"pool_size": 4, "max_overflow": 0, "pool_timeout": 8}
    kw: dict[str, Any] = {"stale_after": 1.0, "heartbeat": 0.2, "concurrency": 2, "batch": 2}
    with (
        _worker_running(db_url, async_url, flavour, make_handler, pool, release, **kw),
        engine.connect() as locker,
        engine.connect() as rescuer,
    ):
        for _ in range(2):
            assert started.acquire(timeout=20)
        with caplog.at_level(logging.WARNING, logger="sa_outbox"):
            locker.begin()
            locker.execute(text("SELECT id FROM jobs WHERE id = 1 FOR UPDATE"))
            time.sleep(2.0)
            locker.commit()
            taken = [r[0] for r in eng.rescue(rescuer, JOBS, stale_after=timedelta(seconds=1))]
            rescuer.commit()
        assert 2 not in taken, "the heartbeat waited for the pool and job 2's lease ran out"
        assert any("lease guard skipped" in r.getMessage() for r in caplog.records)


@contextlib.contextmanager
def _expired_and_guardable(engine: Engine, n: int) -> Any:
    """``n`` jobs claimed by a worker, their leases run out; yields an autocommit connection to take their
    guards on, dropped without a word at the end (as a killed worker's)."""
    seed_jobs(engine, n)
    with engine.begin() as conn:
        claim_jobs(conn, "w1", n)
    expire_leases(engine, "jobs")
    guard = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
    try:
        yield guard
    finally:
        guard.invalidate()
        guard.close()


def _rescued(engine: Engine) -> list[int]:
    with engine.begin() as conn:
        return [r[0] for r in eng.rescue(conn, JOBS, stale_after=timedelta(seconds=1))]


def test_a_guard_of_a_worker_frozen_past_its_timeout_is_let_go(engine: Engine) -> None:
    """A worker frozen with its guards held (SIGSTOP, a paused VM) would pin its jobs until TCP gives up (two
    hours with the server's defaults): the guard's transaction ends after ``frozen_after`` idle (the worker's
    stale_after), and the job is rescued like a dead worker's."""
    with _expired_and_guardable(engine, 1) as guard:
        assert eng.guard(guard, JOBS, [1], frozen_after=0.5) == {1}
        assert _rescued(engine) == []
        time.sleep(1.0)  # frozen: not a statement on the guard's connection
        assert _rescued(engine) == [1]


def test_a_guarded_lease_is_rescued_once_its_guards_connection_is_gone(engine: Engine) -> None:
    """The guard only protects a job while its worker's connection lives: an expired job whose guard is held
    is left alone by every rescue; when the guard's session ends (its worker was killed, its connection
    dropped) the next rescue takes the job back. Another job, expired and unguarded, is rescued at once. A
    second guard of a guarded job is refused without waiting (a worker that lost the job, say)."""
    with _expired_and_guardable(engine, 2) as guard:
        assert eng.guard(guard, JOBS, [1], frozen_after=60) == {1}
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as other:
            assert eng.guard(other, JOBS, [1], frozen_after=60) == set()  # held: refused, not waited for
            eng.unguard(other)
        assert _rescued(engine) == [2]
        assert _rescued(engine) == []
        pid = guard.exec_driver_sql("SELECT pg_backend_pid()").scalar()
    # the guard's session has ended without a word; the server notices the closed socket a moment later
    deadline = time.monotonic() + 10
    with engine.connect() as probe:
        while probe.execute(
            text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p"), {"p": pid}
        ).scalar():
            probe.rollback()
            assert time.monotonic() < deadline, "the guard's backend did not end"
            time.sleep(0.01)
    assert _rescued(engine) == [1]


def test_failed_jobs_are_requeued_by_id_or_filter(engine: Engine) -> None:
    seed_jobs(engine, 2, task="perm", queue="mail")
    seed_jobs(engine, 1, task="other")

    def fail(job: ClaimedJob) -> None:
        raise PermanentError("SMTP Timeout" if job.task == "perm" else "boom")

    drain(worker(engine, {"perm": fail, "other": fail}, queues=("default", "mail")))
    assert statuses(engine, "jobs") == {"failed": 3}
    assert retry_dead(engine, Job, error_contains="Timeout", dry_run=True) == [1, 2]
    assert statuses(engine, "jobs") == {"failed": 3}  # dry run changed nothing
    assert retry_dead(engine, Job, queue="mail", error_contains="Timeout", batch_size=1) == [1, 2]
    r = row(engine, "jobs", 1)
    assert (r.status, r.attempts, r.finished_at) == ("queued", 0, None)
    assert "requeued by operator" in r.last_error
    assert retry_dead(engine, Job, ids=[3]) == [3]
    with pytest.raises(ConfigurationError, match="name the rows to act on"):
        retry_dead(engine, Job)


def test_failed_jobs_are_discarded_by_skip_dead_final_and_purged_with_the_finished(engine: Engine) -> None:
    """Before: skip_dead refused jobs and purge skips failed ones — a triaged failed job could only be run
    again or deleted by hand, and ``check`` stayed red (a review). Skipped, it is cancelled: final, never
    claimed again, no longer counted as failed, purged with the finished ones."""
    from sa_outbox import purge

    seed_jobs(engine, 3, task="t", status="failed", last_error="boom")
    assert skip_dead(engine, Job, ids=[1, 2], dry_run=True) == [1, 2]
    assert statuses(engine, "jobs") == {"failed": 3}
    assert skip_dead(engine, Job, error_contains="boom", ids=[1, 2]) == [1, 2]
    r = row(engine, "jobs", 1)
    assert (r.status, r.finished_at is not None) == ("cancelled", True)
    assert r.last_error == "boom\ndiscarded by operator (not run again)"
    assert skip_dead(engine, Job, ids=[1]) == []  # no longer failed: nothing to change
    ran: list[int] = []
    drain(worker(engine, {"t": lambda job: ran.append(job.id)}))
    assert ran == [] and statuses(engine, "jobs") == {"cancelled": 2, "failed": 1}
    assert purge(engine, Job, older_than=0) == 2
    assert statuses(engine, "jobs") == {"failed": 1}


def test_no_key_update_claim_does_not_block_child_fk_inserts(engine: Engine) -> None:
    """The jobs document: FOR UPDATE blocks INSERTs into a child table (FOR KEY SHARE); NO KEY UPDATE does not."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "CREATE TABLE IF NOT EXISTS job_logs (id bigserial PRIMARY KEY, job_id bigint REFERENCES jobs (id))"
            )
        )
    try:
        seed_jobs(engine, 1)
        timings: dict[str, float] = {}
        for mode in ("claim", "for_update"):
            with engine.connect() as holder:
                holder.begin()
                if mode == "claim":
                    claim_jobs(holder, "A")  # our claim, left open
                else:
                    holder.execute(text("SELECT id FROM jobs WHERE id = 1 FOR UPDATE"))
                with engine.connect() as child:
                    # LOCAL: a plain SET stayed on the pooled connection after the commit, and a later test's
                    # statement that waits on a lock on purpose was cancelled after 1 s
                    child.execute(text("SET LOCAL lock_timeout = '1s'"))
                    started = time.monotonic()
                    try:
                        child.execute(text("INSERT INTO job_logs (job_id) VALUES (1)"))
                        child.commit()
                    except Exception:
                        child.rollback()
                        timings[mode + "_blocked"] = 1
                    timings[mode] = time.monotonic() - started
                holder.rollback()
        print(
            f"child FK insert while a claim holds the row: {timings['claim'] * 1000:.1f} ms; "
            f"while SELECT ... FOR UPDATE holds it: blocked until lock_timeout ({timings['for_update'] * 1000:.0f} ms)"
        )
        assert "claim_blocked" not in timings and timings["claim"] < 0.5, timings
        assert "for_update_blocked" in timings  # the FOR UPDATE contrast hit lock_timeout
    finally:
        with engine.begin() as conn:
            conn.execute(text("DROP TABLE job_logs"))


def test_concurrency_runs_handlers_in_parallel_threads(engine: Engine) -> None:
    seed_jobs(engine, 8, task="sleep")
    w = worker(engine, {"sleep": lambda j: time.sleep(0.3)}, batch=8, concurrency=8)
    started = time.monotonic()
    assert w.run_once() == 8
    elapsed = time.monotonic() - started
    w.close()
    assert elapsed < 8 * 0.3 * 0.6  # clearly not serial (2.4 s)
    assert statuses(engine, "jobs") == {"done": 8}


def test_stop_finishes_the_job_in_hand_and_releases_the_rest(engine: Engine) -> None:
    seed_jobs(engine, 5, task="stopper")
    holder: list[Worker] = []

    def stopper(job: ClaimedJob) -> None:
        holder[0].stop()

    w = worker(engine, {"stopper": stopper}, batch=5)
    holder.append(w)
    assert w.run_once() == 5
    assert statuses(engine, "jobs") == {"done": 1, "queued": 4}
    with engine.connect() as conn:
        assert set(conn.execute(text("SELECT attempts FROM jobs WHERE status = 'queued'")).scalars()) == {0}


def test_multiple_queues_are_claimed_in_the_given_order(engine: Engine) -> None:
    seed_jobs(engine, 2, queue="low")
    seed_jobs(engine, 2, queue="high")
    order: list[str] = []
    w = worker(engine, {"noop": lambda j: order.append(j.queue)}, queues=("high", "low"), batch=3)
    assert w.run_once() == 3
    assert sorted(order) == ["high", "high", "low"]


def test_priority_then_run_at_order(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        enqueue(s, Job, "noop", {"p": 0}, priority=0)
        enqueue(s, Job, "noop", {"p": 9}, priority=9)
        enqueue(s, Job, "noop", {"p": 5}, priority=5)
    seen: list[int] = []
    drain(worker(engine, {"noop": lambda j: seen.append(j.payload["p"])}, batch=1))
    assert seen == [9, 5, 0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"queues": "default"}, "queues must be a collection"),
        ({"queues": ()}, "queues must be non-empty"),
        ({"batch": -1}, "batch must be an integer >= 1"),
        ({"stale_after": 0}, "stale_after must be > 0"),
        ({"stale_after": 1, "heartbeat": 2}, "heartbeat must be shorter than stale_after"),
        ({"concurrency": 0}, "concurrency must be an integer >= 1"),
    ],
)
def test_invalid_worker_options(engine: Engine, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Worker(engine, Job, {}, **kwargs)


def test_worker_refuses_an_outbox_model(engine: Engine) -> None:
    with pytest.raises(ConfigurationError, match="needs a JobMixin model"):
        Worker(engine, OutboxEvent, {})


def _drain_spied(
    engine: Engine, jobs: int, handler: Any, longest: float | None = None
) -> tuple[Worker, list[int]]:
    """Drain ``jobs`` jobs (batch 5, concurrency 1) through ``handler``; also returns how many jobs were still
    queued in hand each time the worker sent a claim on its claim thread. ``longest``: the pace observes a job as
    taking at most that long (the scheduler's preemptions taken out of the measurement — see the no-op test)."""
    seed_jobs(engine, jobs, task="t")
    w = Worker(engine, Job, {"t": handler}, batch=5, listen=False)
    in_hand_at_send: list[int] = []
    submit = w._claimer.submit

    def spy(*args: Any) -> Any:
        in_hand_at_send.append(len(w._queue))
        return submit(*args)

    w._claimer.submit = spy  # type: ignore[method-assign]
    if longest is not None:
        observe = w._pace.observe
        w._pace.observe = lambda seconds: observe(min(seconds, longest))  # type: ignore[method-assign]
    try:
        w.run(install_signal_handlers=False, until_idle=True)
    finally:
        w.close()
    return w, in_hand_at_send


def test_an_inline_worker_claims_the_next_batch_beside_jobs_that_take_time(engine: Engine) -> None:
    """Concurrency 1, jobs of ~0.5 ms: run() sends the next claim (with the outcomes due) on the claim thread
    while jobs are still queued in hand, so its round trip overlaps them. Every job still runs once and every
    outcome is written — the last batch's by the end of run()."""
    seen: list[int] = []

    def half_ms(job: ClaimedJob) -> None:
        time.sleep(0.0005)
        seen.append(job.id)

    w, in_hand_at_send = _drain_spied(engine, 40, half_ms)
    assert sorted(seen) == list(range(1, 41))
    assert statuses(engine, "jobs") == {"done": 40}
    assert w.stats.done == 40
    assert max(in_hand_at_send, default=0) >= 1, in_hand_at_send  # sent while jobs were still queued


def test_an_inline_worker_claims_on_its_own_thread_beside_a_batch_of_no_op_jobs(engine: Engine) -> None:
    """No-op handlers never release the GIL: the claim thread could not even send its statement before the
    batch ended, so its hand-off would only cost. The worker sends the claim from its own thread (read after
    the batch), never on the claim thread (the old rule sent every batch after the first there).

    What a no-op job measures depends on the machine: on a busy one the scheduler preempts one job for
    milliseconds now and then, which lifts the moving average (and rightly sends a few batches to the thread —
    CI once saw 60 of 80). The pace here observes each job as at most 50 µs, the most an unpreempted no-op
    takes, so the test checks the path from the pace to the send, whatever else the machine runs; the rule on
    the averages is the table test below."""
    seen: list[int] = []
    w, in_hand_at_send = _drain_spied(engine, 400, lambda j: seen.append(j.id), longest=50e-6)
    assert sorted(seen) == list(range(1, 401))
    assert statuses(engine, "jobs") == {"done": 400}
    assert w.stats.batches >= 80
    assert w._pace.average is not None and w._pace.average <= 50e-6
    assert in_hand_at_send == [], in_hand_at_send


@pytest.mark.parametrize(
    ("average", "queued", "how"),
    [
        (3e-6, 0, "ahead"),  # no-op jobs: sent by the loop's thread itself, read after them
        (3e-6, 4, "ahead"),
        (0.0005, 0, "ahead"),  # the last job alone is too short to hide a hand-off
        (0.0005, 1, "thread"),  # two jobs of 0.5 ms left, the rest done within a round trip
        (0.0005, 4, "thread"),  # 2 ms left after this one: one (guessed) round trip
        (0.0005, 5, None),  # more than a round trip left: later
        (0.005, 0, "thread"),  # a long last job
        (0.005, 1, None),
        (3e-6, 700, None),  # 2.1 ms of no-op jobs left: later
    ],
)
def test_the_claim_goes_beside_the_jobs_in_hand_only_when_they_hide_its_round_trip(
    average: float, queued: int, how: str | None
) -> None:
    pace = _Pace()
    assert pace.claim_beside(queued) is None  # nothing measured yet
    pace.observe(average)
    assert pace.trip == TRIP_GUESS == 0.002
    assert pace.claim_beside(queued) == how


def _drain_async(async_url: Any, handlers: dict[str, Any], **kw: Any) -> AsyncWorker:
    async def go() -> AsyncWorker:
        aengine = create_async_engine(async_url)
        w = AsyncWorker(aengine, Job, handlers, listen=False, **kw)
        try:
            await w.run(install_signal_handlers=False, until_idle=True)
        finally:
            await w.close()
            await aengine.dispose()
        return w

    return asyncio.run(go())


def test_an_inline_async_worker_runs_sync_handlers_in_turn_on_one_thread_call_never_on_the_loop(
    engine: Engine, async_url: Any
) -> None:
    """AsyncWorker, concurrency 1, sync handlers: the jobs in hand run in order on a handler thread (one hand-off
    for the batch), none on the event loop's thread; async def handlers in between are awaited in turn."""
    seed_jobs(engine, 12, task="sync")
    seed_jobs(engine, 2, task="async")
    seed_jobs(engine, 6, task="sync")
    order: list[int] = []
    threads: set[int] = set()
    loop_threads: set[int] = set()

    def sync_handler(job: ClaimedJob) -> None:
        threads.add(threading.get_ident())
        order.append(job.id)

    async def async_handler(job: ClaimedJob) -> None:
        loop_threads.add(threading.get_ident())
        order.append(job.id)

    w = _drain_async(async_url, {"sync": sync_handler, "async": async_handler}, batch=5)
    assert order == list(range(1, 21))
    assert statuses(engine, "jobs") == {"done": 20}
    assert w.stats.done == 20
    assert threads and not threads & loop_threads


def test_an_inline_async_worker_stopped_mid_batch_gives_back_the_sync_jobs_it_did_not_start(
    engine: Engine, async_url: Any
) -> None:
    seed_jobs(engine, 6, task="t")
    ran: list[int] = []
    holder: list[AsyncWorker] = []

    def handler(job: ClaimedJob) -> None:
        ran.append(job.id)
        if job.id == 2:
            holder[0].stop()

    async def go() -> None:
        aengine = create_async_engine(async_url)
        w = AsyncWorker(aengine, Job, {"t": handler}, listen=False, batch=6)
        holder.append(w)
        try:
            await w.run(install_signal_handlers=False)
        finally:
            await w.close()
            await aengine.dispose()

    asyncio.run(go())
    assert ran == [1, 2]
    assert statuses(engine, "jobs") == {"done": 2, "queued": 4}
    for i in range(3, 7):
        r = row(engine, "jobs", i)
        assert (r.attempts, r.locked_by) == (0, None), r


def test_an_inline_async_worker_skips_a_sync_job_cancelled_while_it_waited_in_hand(
    engine: Engine, async_url: Any
) -> None:
    """The batch's thread checks each job's cancellation (learned by the heartbeat on the event loop) before
    starting it."""
    seed_jobs(engine, 3, task="t")
    ran: list[int] = []

    def handler(job: ClaimedJob) -> None:
        ran.append(job.id)
        if job.id == 1:
            cancel_jobs(engine, Job, ids=[3])
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not _cancel_seen(engine):
                time.sleep(0.05)
            time.sleep(0.5)  # several heartbeats: the worker has set job 3's token

    _drain_async(async_url, {"t": handler}, batch=3, heartbeat=0.1)
    assert ran == [1, 2]
    assert row(engine, "jobs", 3).status == "cancelled"
    assert statuses(engine, "jobs") == {"done": 2, "cancelled": 1}


def _cancel_seen(engine: Engine) -> bool:
    with engine.connect() as conn:
        return bool(
            conn.execute(text("SELECT cancel_requested_at IS NOT NULL FROM jobs WHERE id = 3")).scalar_one()
        )


def test_jobs_claimed_beside_a_long_inline_job_are_renewed_by_the_heartbeat_at_once(engine: Engine) -> None:
    """The claim sent beside the first job of a batch lands while a job of the batch runs longer than
    stale_after: its rows must be in hand for the heartbeat from the moment it lands, or the worker's own
    rescue takes them back and they run twice (found by a hostile review)."""
    seed_jobs(engine, 12, task="t")
    runs: dict[int, int] = {}

    def handler(job: ClaimedJob) -> None:
        runs[job.id] = runs.get(job.id, 0) + 1
        if job.id == 3:
            time.sleep(2.5)

    w = Worker(engine, Job, {"t": handler}, listen=False, stale_after=1.0, heartbeat=0.2, batch=4)
    try:
        w.run(install_signal_handlers=False, until_idle=True)
    finally:
        w.close()
    assert {i: n for i, n in runs.items() if n > 1} == {}
    assert sorted(runs) == list(range(1, 13))
    assert statuses(engine, "jobs") == {"done": 12}
    assert w.stats.lost_leases == 0


def test_a_loop_keeps_its_cursor_only_on_its_own_connection_never_on_one_the_pool_hands_out_again(
    engine: Engine,
) -> None:
    """The loops reuse one cursor per connection (it holds the last statement's parameters and rows); an
    application connection — an enqueue's — never keeps one, and a loop's is dropped when it lets go."""
    from sa_outbox._execute import _CURSOR

    with Session(engine) as session:
        enqueue(session, Job, "t", {"big": "x" * 100_000})
        session.commit()
        assert _CURSOR not in session.connection().connection.info
    seen: list[dict[Any, Any]] = []

    def handler(job: ClaimedJob) -> None:  # inline: the loop holds its connection meanwhile
        conn = w._db._conn
        assert conn is not None
        seen.append(conn.connection.info)
        assert _CURSOR in conn.connection.info

    w = Worker(engine, Job, {"t": handler}, listen=False)
    w.run_once()
    w.close()
    assert len(seen) == 1 and _CURSOR not in seen[0]
    assert statuses(engine, "jobs") == {"done": 1}


def test_claimed_payloads_decode_with_the_engines_json_deserializer(engine: Engine) -> None:
    """A claim returns the payload's JSON text; it is decoded as the engine decodes JSON (``json_deserializer``
    given to create_engine, e.g. floats as Decimal) — for jobs and for outbox events alike."""
    import json
    from decimal import Decimal

    from sqlalchemy import create_engine

    from sa_outbox import Dispatcher

    decimal_engine = create_engine(engine.url, json_deserializer=lambda s: json.loads(s, parse_float=Decimal))
    try:
        seed_jobs(engine, 1, task="t")
        with engine.begin() as conn:
            conn.execute(text("""UPDATE jobs SET payload = '{"price": 0.1, "n": [1, "x"]}'"""))
            conn.execute(
                text(
                    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                    """VALUES ('order', '1', 'E', '{"price": 0.1}')"""
                )
            )
        got: list[Any] = []
        drain(Worker(decimal_engine, Job, {"t": lambda j: got.append(j.payload)}))
        publisher = RecordingPublisher()
        drain(Dispatcher(decimal_engine, OutboxEvent, publisher))
        assert got == [{"price": Decimal("0.1"), "n": [1, "x"]}]
        assert isinstance(got[0]["price"], Decimal)
        assert [m.payload for m in publisher.messages] == [{"price": Decimal("0.1")}]
        plain: list[Any] = []
        seed_jobs(engine, 1, task="t")
        drain(Worker(engine, Job, {"t": lambda j: plain.append(j.payload)}))
        assert plain == [{"n": 0}] and isinstance(plain[0]["n"], int)
    finally:
        decimal_engine.dispose()


def test_run_with_max_batches_claims_no_batch_beyond_the_last_one(engine: Engine) -> None:
    seed_jobs(engine, 30, task="t")
    seen: list[int] = []
    w = Worker(engine, Job, {"t": lambda j: seen.append(j.id)}, batch=5, listen=False)
    w.run_once()  # a first batch: the worker now knows its jobs are short and claims ahead
    w.run(install_signal_handlers=False, max_batches=2)
    w.close()
    assert len(seen) == 15
    with engine.connect() as conn:
        versions = dict(conn.execute(text("SELECT id, lease_version FROM jobs")).all())
    assert sorted(i for i, v in versions.items() if v > 0) == sorted(seen), "a claim beyond max_batches"


def test_cancelling_an_inline_async_workers_run_lets_the_handler_in_progress_finish(
    engine: Engine, async_url: Any
) -> None:
    seed_jobs(engine, 3, task="t")
    finished: list[int] = []

    async def handler(job: ClaimedJob) -> None:
        await asyncio.sleep(0.6)
        finished.append(job.id)

    async def go() -> None:
        aengine = create_async_engine(async_url)
        w = AsyncWorker(aengine, Job, {"t": handler}, listen=False, batch=3)
        task = asyncio.ensure_future(w.run(install_signal_handlers=False))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await w.close()
        await aengine.dispose()

    asyncio.run(go())
    assert finished == [1]
    assert row(engine, "jobs", 1).status == "done"
    for i in (2, 3):
        r = row(engine, "jobs", i)
        assert (r.status, r.attempts) == ("queued", 0), r


@pytest.mark.parametrize("flavour", ["sync", "async def"])
def test_an_inline_async_worker_writes_finished_outcomes_while_a_long_job_runs(
    engine: Engine, async_url: Any, flavour: str
) -> None:
    seed_jobs(engine, 5, task="t")
    seen_done: list[int] = []

    def check() -> None:
        with engine.connect() as conn:
            seen_done.append(
                conn.execute(text("SELECT count(*) FROM jobs WHERE status = 'done' AND id < 5")).scalar_one()
            )

    def sync_handler(job: ClaimedJob) -> None:
        if job.id == 5:
            time.sleep(0.5)
            check()

    async def async_handler(job: ClaimedJob) -> None:
        if job.id == 5:
            await asyncio.sleep(0.5)
            await asyncio.to_thread(check)

    handler = sync_handler if flavour == "sync" else async_handler
    _drain_async(async_url, {"t": handler}, batch=5)
    assert seen_done == [4], "outcomes of finished jobs waited for the long one"
    assert statuses(engine, "jobs") == {"done": 5}


def _backends_gone(engine: Engine, app: str, within: float = 5.0) -> bool:
    """Whether no server session of ``application_name`` = ``app`` is left, waiting up to ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        with engine.connect() as conn:
            left = conn.execute(
                text("SELECT count(*) FROM pg_stat_activity WHERE application_name = :a"), {"a": app}
            ).scalar_one()
        if not left or time.monotonic() >= deadline:
            return not left
        time.sleep(0.05)


def test_an_async_workers_sync_engine_closes_the_connection_a_handler_kept_past_its_timeout(
    engine: Engine, async_url: Any
) -> None:
    """A sync handler that takes a session runs on a thread with a connection of the AsyncWorker's own sync
    engine. One that overran handler_timeout is abandoned and may still run when the worker closes: the engine
    is disposed once that call has ended, so the connection it gives back is closed, not left open (a server
    session) in a pool that was disposed before it came back."""
    seed_jobs(engine, 1)
    app = f"sao_abandoned_{time.monotonic_ns()}"
    url = async_url.update_query_dict({"application_name": app})
    ended = threading.Event()

    def handler(job: ClaimedJob, session: Session) -> None:
        session.execute(text("SELECT 1"))
        time.sleep(1.0)  # past handler_timeout, and past the worker's close
        ended.set()

    w = _drain_async(url, {"noop": handler}, handler_timeout=0.2)
    assert w.stats.timed_out == 1 and not ended.is_set()
    assert ended.wait(5)
    assert _backends_gone(engine, app)


def test_an_async_workers_sync_engine_check_cut_short_by_the_timeout_leaves_no_connection_open(
    engine: Engine, async_url: Any
) -> None:
    """The first session-taking sync handler of an AsyncWorker checks the worker's own sync engine, within the
    handler's timeout, on a thread of asyncio's: cut short there (a slow connect), that thread gives its
    connection back after the worker closed — it must be closed too. (Found by review of the test above.)"""
    seed_jobs(engine, 1)
    app = f"sao_check_{time.monotonic_ns()}"
    url = async_url.update_query_dict({"application_name": app})

    def slow(dbapi_connection: Any, record: Any) -> None:  # the sync engine's connect, on asyncio's thread
        if threading.current_thread().name.startswith("asyncio_"):
            time.sleep(0.6)

    def handler(job: ClaimedJob, session: Session) -> None:
        session.execute(text("SELECT 1"))

    event.listen(Pool, "connect", slow)
    gc.disable()  # a collection would close the left connection and hide the leak
    try:
        w = _drain_async(url, {"noop": handler}, handler_timeout=0.2)
        assert w.stats.timed_out == 1
        assert _backends_gone(engine, app)
    finally:
        gc.enable()
        event.remove(Pool, "connect", slow)


# --- the levels form: jobs scheduled for later are not walked after a short claim -------------------------


def _far_future_jobs(engine: Engine, later: int, priorities: str) -> None:
    """``later`` jobs scheduled for tomorrow (priority: ``priorities``, an SQL expression of g) and three due
    now, of priorities 0, 1 and 2; vacuumed and analyzed."""
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO jobs (task, payload, run_at, priority) "
            f"SELECT 'noop', '{{}}', now() + interval '1 day', {priorities} FROM generate_series(1, :n) g"
        ), {"n": later})  # fmt: skip
        conn.execute(
            text(
                "INSERT INTO jobs (task, payload, priority) SELECT 'noop', '{}', g FROM generate_series(0, 2) g"
            )
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE jobs"))


def _analyzed_claim(engine: Engine, **shape: Any) -> dict[str, Any]:
    stmt = eng._sql.claim_statement(JOBS, limit=10, **shape)
    with engine.connect() as conn:
        compiled = stmt.compile(dialect=conn.dialect)
        plan: dict[str, Any] = conn.exec_driver_sql(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + str(compiled),
            compiled.construct_params({"owner": "w", "queue_name": "default"}),
        ).scalar_one()[0]["Plan"]
        conn.rollback()
    return plan


@pytest.mark.parametrize("unique_running", [False, True], ids=["plain", "unique_running"])
def test_the_levels_form_of_a_claim_short_of_due_jobs_does_not_read_the_jobs_scheduled_for_later(
    engine: Engine, unique_running: bool
) -> None:
    """50,000 jobs scheduled for tomorrow over three priorities, three due now: the levels form of a claim of
    10 takes the three and stops. The usual form reads the dequeue index across priorities, where
    ``run_at <= now()`` is only a filter: a claim that finds fewer due jobs than its batch reads every job
    scheduled for later (500-750 buffers here on PostgreSQL 15; 18's skip scan spares it)."""
    _far_future_jobs(engine, 50_000, "g % 3")
    plan = _analyzed_claim(engine, levels=True, unique_running=unique_running)
    assert plan["Actual Rows"] == 3
    touched = plan["Shared Hit Blocks"] + plan.get("Shared Read Blocks", 0)
    assert touched < 120, touched  # (about 60)
    with engine.begin() as conn:
        rows = eng.claim(
            conn, JOBS, owner="w", batch=10, queue="default", unique_running=unique_running, levels=True
        )
    assert [(r[0], r[7]) for r in rows] == [(50003, 2), (50002, 1), (50001, 0)]  # (the claim order)


def test_the_levels_form_reads_a_bounded_number_of_priority_levels(engine: Engine) -> None:
    """Every job its own priority (20,000 for tomorrow, three due now): level by level, a claim would take two
    descents per priority (541 ms a claim with 100,000); the levels form reads ``PRIORITY_LEVELS`` levels so,
    then the rest of the queue in the index's order, and still claims exactly the due jobs."""
    _far_future_jobs(engine, 20_000, "g")
    plan = _analyzed_claim(engine, levels=True)

    def nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
        return [node, *(n for child in node.get("Plans", []) for n in nodes(child))]

    (levels,) = [n for n in nodes(plan) if n["Node Type"] == "Recursive Union"]
    assert levels["Actual Rows"] == eng._sql.PRIORITY_LEVELS, levels["Actual Rows"]
    assert plan["Actual Rows"] == 3


@pytest.mark.parametrize("seed", range(6))
def test_the_levels_form_claims_what_the_usual_form_claims(engine: Engine, seed: int) -> None:
    """Random queues, priorities, due and later jobs, unique keys: for one queue or three (with and without
    rooms), plain and unique_running, the levels form claims exactly the rows of the usual form, in the same
    order (each claim in a transaction rolled back)."""
    import random

    rnd = random.Random(seed)

    def add(conn: Any, n: int) -> None:
        # (at most one waiting job per unique key: ux_jobs_unique; ON CONFLICT leaves the key's first)
        for _ in range(n):
            conn.execute(
                text(
                    "INSERT INTO jobs (task, payload, queue, priority, run_at, unique_key) VALUES "
                    "('noop', '{}', :q, :p, now() + make_interval(secs => :d), :k) ON CONFLICT DO NOTHING"
                ),
                {
                    "q": rnd.choice(["a", "b", "c"]),
                    "p": rnd.choice([-5, 0, 0, 1, 3, 7, *range(20, 40)]),
                    "d": rnd.choice([-60, -1, 0, 3600]),
                    "k": rnd.choice([None, None, None, "k1", "k2", "k3", "k4", "k5", "k6"]),
                },
            )

    with engine.begin() as conn:
        add(conn, rnd.randint(20, 200))
        conn.execute(text("UPDATE jobs SET status = 'running', locked_at = now() WHERE id % 5 = 0"))
        add(conn, rnd.randint(10, 60))  # (more waiting jobs, some of keys now running)
    calls: list[dict[str, Any]] = [
        {"queue": "a"},
        {"queue": ["b", "a", "c"]},
        {"queue": ["c", "b"], "rooms": [2, 30]},
    ]
    for call in calls:
        for unique_running in (False, True):
            for batch in (1, 7, 50):
                got = {}
                for levels in (False, True):
                    with engine.connect() as conn:
                        rows = eng.claim(conn, JOBS, owner="w", batch=batch, unique_running=unique_running,
                                         levels=levels, **call)  # fmt: skip
                        conn.rollback()
                    got[levels] = [r[0] for r in rows]
                assert got[True] == got[False], (call, unique_running, batch)


@pytest.mark.parametrize("batch", [3, 10])
@pytest.mark.parametrize("limited", [False, True], ids=["plain", "limited"])
def test_a_batch_of_jobs_runs_in_priority_then_run_at_order_not_id_order(
    runner: Any, engine: Engine, batch: int, limited: bool
) -> None:
    """Within a queue jobs run by priority (higher first), then run_at, then id — inside one claimed batch
    too. The claim returned its rows by id: a worker of batch 10 and one handler at a time ran a priority-0
    job before the priority-20 job claimed with it (a hostile review's script). Batch 3: the first claim and
    the claims that write the previous batch's outcomes in the same statement; limited: a queue with a Limit,
    claimed by its own statements."""
    from sqlalchemy import func, insert

    from sa_outbox import Limit

    # (priority, seconds ago it became due), in id order: the run order is the ids 4, 3, 2, 5, 1, 6
    shape = [(0, 1), (5, 1), (5, 10), (20, 1), (0, 5), (-1, 30)]
    with engine.begin() as conn:
        for priority, ago in shape:
            conn.execute(insert(Job).values(task="t", queue="default", payload={}, priority=priority,
                                            run_at=func.now() - timedelta(seconds=ago)))  # fmt: skip
    ran: list[int] = []
    kw: dict[str, Any] = {"limits": {"default": Limit(5)}} if limited else {}
    w = runner.worker({"t": lambda job: ran.append(job.id)}, batch=batch, concurrency=1, **kw)
    runner.drain(w)
    assert ran == [4, 3, 2, 5, 1, 6]
    assert statuses(engine, "jobs") == {"done": 6}


@pytest.mark.parametrize("shares", [False, True], ids=["queues", "shares"])
def test_a_batch_from_two_queues_runs_one_queues_jobs_then_the_others_each_by_priority(
    runner: Any, engine: Engine, shares: bool
) -> None:
    """A worker of queues ["a", "b"] (one statement claims both), one job at a time: a batch holding jobs of
    both runs a's first, then b's, each queue's by priority. With shares the queues take turns being first.
    (A concurrency of 1 given with shares is kept: it was taken for the default, and the shares' sum ran
    jobs side by side.)"""
    from sqlalchemy import insert

    with engine.begin() as conn:  # ids 1-6: b 0, a 0, b 9, a 9, b 5, a 5
        for i in range(6):
            conn.execute(
                insert(Job).values(task="t", queue="ab"[(i + 1) % 2], payload={}, priority=(0, 9, 5)[i // 2])
            )
    ran: list[int] = []
    queues: Any = {"a": 3, "b": 3} if shares else ["a", "b"]
    w = runner.worker({"t": lambda job: ran.append(job.id)}, queues=queues, batch=6, concurrency=1)
    assert w.concurrency == 1
    runner.drain(w)
    a, b = [4, 6, 2], [3, 5, 1]
    assert ran in ([a + b, b + a] if shares else [a + b])
    assert statuses(engine, "jobs") == {"done": 6}


def test_a_worker_claims_in_the_levels_form_after_a_short_claim_and_walks_after_a_full_one(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's claims: the first is the usual form; one that comes back short makes the next the levels
    form; one that comes back full makes the next the usual form again."""
    shapes = claim_forms_sent(monkeypatch, "levels")
    seed_jobs(engine, 3, task="t")
    w = Worker(engine, Job, {"t": lambda job: None}, batch=5, listen=False, poll_interval=0.05)
    try:
        assert w.run_once() == 3  # (asked 5, got 3: short)
        seed_jobs(engine, 12, task="t")
        assert w.run_once() == 5  # the levels form; full
        assert w.run_once() == 5  # the usual form
        assert shapes[:3] == [False, True, False], shapes
    finally:
        w.close()
    assert statuses(engine, "jobs") == {"done": 13, "queued": 2}


def test_a_worker_with_shares_claims_in_the_usual_form_while_its_rooms_fill(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker of two queues with shares of 2 each and batch 10 asks each claim for at most 4 rows (the rooms):
    a claim that takes 4 is full, not short, and the next one stays in the usual form. Counted against the
    batch, every such claim was short, and a review's drain of 4,000 jobs sent 966 of its 1,965 claims in the
    levels form."""
    shapes = claim_forms_sent(monkeypatch, "levels")
    for queue in ("a", "b"):
        seed_jobs(engine, 20, task="t", queue=queue)
    w = Worker(engine, Job, {"t": lambda job: None}, queues={"a": 2, "b": 2}, batch=10, listen=False)
    try:
        w.run(install_signal_handlers=False, until_idle=True)
    finally:
        w.close()
    assert statuses(engine, "jobs") == {"done": 40}
    # (a claim may still come back short now and then — one queue empty, the other's room not filled, a claim
    # sent ahead with a job in hand, a loaded machine — and switch forms once; before, every other one did)
    assert len(shapes) >= 10 and shapes.count(True) <= len(shapes) // 3, shapes


def test_a_heartbeat_that_waited_half_of_stale_after_is_logged(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """Leases live only while beats get through in time: behind a pooler out of server connections (a review:
    PgBouncer's pool of 2, one held by a transaction over a job's row, one by the lease guard), beats waited in
    its queue past stale_after and other workers rescued live jobs — with nothing in the log to say why. A beat
    that took more than half of stale_after now says so."""
    seed_jobs(engine, 1, task="slow")

    def slow(job: Any) -> None:
        with (
            engine.begin() as conn
        ):  # the beat's UPDATE waits for this lock (its SKIP LOCKED skips row locks)
            conn.execute(text("LOCK TABLE jobs IN SHARE MODE"))
            time.sleep(2.4)  # (the first beat, 0.3 s in, waits ~2.1 s: more than half of stale_after)

    w = Worker(engine, Job, {"slow": slow}, stale_after=3, heartbeat=0.3, poll_interval=0.1)
    with caplog.at_level(logging.WARNING, logger="sa_outbox"):
        drain(w)
    slow_beats = [r.getMessage() for r in caplog.records if "heartbeat: renewing" in r.getMessage()]
    assert slow_beats and "(stale_after 3 s): its statement waited" in slow_beats[0], caplog.text
    assert statuses(engine, "jobs") == {"done": 1}


def test_a_stop_starts_no_rescue_between_the_jobs_in_hand(engine: Engine) -> None:
    """The inline loop's once-a-second maintenance ran a rescue after a stop was asked; on a server that had
    stopped answering that statement held the stop for good (a review). After a stop only the jobs in hand
    are recorded."""
    seed_jobs(engine, 2, task="t")
    after_stop: list[str] = []
    w: Worker

    def first(job: Any) -> None:
        w.stop()
        time.sleep(1.2)  # the rescue is due again (every second) when this job ends

    def watch(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if w.stopping and "pg_locks" in statement:  # the rescue's guarded-keys subplan
            after_stop.append(statement)

    w = Worker(engine, Job, {"t": first}, batch=2, concurrency=1)
    event.listen(engine, "before_cursor_execute", watch)
    try:
        w.run(install_signal_handlers=False)
    finally:
        event.remove(engine, "before_cursor_execute", watch)
    assert after_stop == []
    assert statuses(engine, "jobs") == {"done": 1, "queued": 1}  # the second given back, not started


@pytest.mark.parametrize("runner", ["sync", "async"], indirect=True)
def test_a_transactional_handler_chooses_its_transactions_isolation_level(
    runner: Any, engine: Engine
) -> None:
    """A handler that takes a session may give its first ``session.connection()`` execution options (a
    ``SERIALIZABLE`` transaction). The worker checks that a connection can be had before it calls the handler
    (a refused one defers the job: tests/test_pgbouncer.py), on a connection of its own: procuring the session's
    connection for that check made SQLAlchemy ignore the handler's options with a warning — its transaction ran
    at the default level."""
    seed_jobs(engine, 1, task="t")
    levels: list[str] = []
    if runner.aengine is not None:

        async def handle_async(job: ClaimedJob, session: Any) -> None:
            conn = await session.connection(execution_options={"isolation_level": "SERIALIZABLE"})
            levels.append((await conn.execute(text("SHOW transaction_isolation"))).scalar_one())

        handler: Any = handle_async
    else:

        def handle(job: ClaimedJob, session: Session) -> None:
            conn = session.connection(execution_options={"isolation_level": "SERIALIZABLE"})
            levels.append(conn.execute(text("SHOW transaction_isolation")).scalar_one())

        handler = handle
    runner.run(runner.worker({"t": handler}), until_idle=True)
    assert levels == ["serializable"]
    assert statuses(engine, "jobs") == {"done": 1}


def test_a_transactional_job_committed_while_its_loop_waits_is_never_reported_lost_by_the_heartbeat(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler that takes a session commits the job's completion with its own work; its loop takes the
    result in when it is next free — here it waits on a claim (held 3 s: a pooler's queue, a slow server).
    Meanwhile the heartbeat found the row done, not renewable: before, the job was still held, a guard found it
    "no longer ours" and the next beats warned "heartbeat: job 1 version 1 is no longer ours (reaped and
    re-claimed?)" for a job that was done, by this worker, once. A completion committed is no longer held."""
    seed_jobs(engine, 1, task="t")
    own = create_engine(engine.url)
    stall, stalled, go = threading.Event(), threading.Event(), threading.Event()

    def hold_claims(conn: Any, cursor: Any, statement: str, parameters: Any, *args: Any) -> None:
        if stall.is_set() and isinstance(parameters, dict) and "expired_for" in parameters:
            stalled.set()
            time.sleep(3.0)

    def handle(job: ClaimedJob, session: Session) -> None:
        go.wait(10)
        session.execute(text("SELECT 1"))

    event.listen(own, "before_cursor_execute", hold_claims)
    w = worker(own, {"t": handle}, concurrency=2, poll_interval=0.05, stale_after=2.0, heartbeat=0.2)
    t = threading.Thread(target=lambda: w.run(install_signal_handlers=False, max_batches=50))
    t.start()
    try:
        assert wait_until(lambda: statuses(engine, "jobs") == {"running": 1}, 10)
        stall.set()
        assert stalled.wait(10), "the loop sent no claim"
        go.set()
        assert wait_until(lambda: statuses(engine, "jobs") == {"done": 1}, 2)
        w.beat_once()
        deadline = time.monotonic() + 2
        while w._guarding and time.monotonic() < deadline:
            time.sleep(0.01)
        w.beat_once()
        w.beat_once()
        assert stalled.is_set()
    finally:
        go.set()
        w.stop()
        t.join(15)
        own.dispose()
    assert not t.is_alive()
    assert not [r.getMessage() for r in caplog.records if "no longer ours" in r.getMessage()]
    assert statuses(engine, "jobs") == {"done": 1} and w.stats.lost_leases == 0


def test_an_async_workers_job_task_that_outlives_close_never_uses_its_disposed_sync_engine(
    engine: Engine, async_url: Any
) -> None:
    """A sync handler that takes a session runs, under the AsyncWorker, on the worker's own sync engine, which
    close() disposes. A job's task that outlived close() (abandoned after its run was cancelled, still waiting
    on a pooler's PAUSE) went on to make that engine again — or, disposed, its new pool — and its connections
    were collected open (the model-based suite, 2 of 26 long scenarios once). After close() the task is
    refused: the job is not run (its worker has ended), and no engine or connection is made."""
    seed_jobs(engine, 1, task="t")
    seen: list[int] = []

    def handle(job: ClaimedJob, session: Session) -> None:
        seen.append(session.execute(text("SELECT 1")).scalar_one())

    async def go() -> None:
        aengine = create_async_engine(async_url)
        w = AsyncWorker(aengine, Job, {"t": handle}, listen=False)
        try:
            await w.run(install_signal_handlers=False, until_idle=True)
            assert w._sync is not None  # made for the job
        finally:
            await w.close()
        job = ClaimedJob(
            id=1, task="t", queue="default", payload={}, attempts=1, max_attempts=3, lease_version=1,
            priority=0, created_at=datetime.now(UTC),
        )  # fmt: skip
        with pytest.raises(RuntimeError, match="not run: its worker was closed"):
            await w._sync_engine(job)
        assert w._sync is None
        await aengine.dispose()

    asyncio.run(go())
    assert seen == [1] and statuses(engine, "jobs") == {"done": 1}
