"""A loop's connection lost inside a limited queue's transaction block (``_execute.transaction``) must not come
back as a connection outside autocommit.

Found by the model-based suite's long profile (seeds 105, 115, 116: "one claim handled twice", a worker's jobs in
hand holding one claim twice) and reduced with real workers: three workers with a limited queue, their
backends terminated every 20 ms for 2.9 s at a time, accepted the same (job, lease_version) twice within 40 s
(2-10 pairs a run: AsyncWorkers in every run, sync Workers too). The claim statement failed on the terminated backend and invalidated the SQLAlchemy
``Connection``; the block's ``ROLLBACK`` then read ``conn.connection``, and SQLAlchemy quietly connected again —
a fresh connection from the pool, without the AUTOCOMMIT the loop had set on the old one. Every later statement
of that loop (claims, finalizes) ran in psycopg's implicit transaction, never committed: the worker ran the jobs
it claimed there, the next termination rolled the claims back, and the rows were claimed again under the same
lease versions — the fencing token handed out twice.
"""

from __future__ import annotations

import asyncio
import io
import logging
import random
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.orm import Session

from sa_outbox import AsyncWorker, Backoff, Defer, Limit, Worker, enqueue_many
from sa_outbox._db import AsyncLoopConnection, LoopConnection
from sa_outbox._execute import in_block, run, transaction
from sa_outbox._worker import WorkerBase
from sa_outbox.models import Job

from .helpers import seed_jobs

_MARK = text("UPDATE jobs SET priority = 7 WHERE id = 1")


def _terminate_inside_a_block(killer: Engine) -> Any:
    """A step on the loop's connection: a transaction block whose statement meets its terminated backend — the
    error caught by the caller, as ``_claim_on`` does when earlier queues' claims of the turn committed."""

    def step(conn: Connection) -> None:
        # (read from the driver, not by a statement through SQLAlchemy: that would begin a SQLAlchemy-level
        # transaction, which a loop's statements never do, and which keeps an invalidated Connection from
        # connecting again)
        pid = conn.connection.driver_connection.info.backend_pid
        with pytest.raises(DBAPIError), transaction(conn):
            with killer.connect() as other:
                other.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
                other.commit()
            run(conn, _MARK, {}, prepare=False)

    return step


def _mark(conn: Connection) -> bool:
    """The next step: one autocommit statement; whether the connection is left inside a block after it."""
    run(conn, _MARK, {}, prepare=False)
    return in_block(conn)


def _committed(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT priority FROM jobs WHERE id = 1")).scalar_one())


def test_a_sync_loop_connection_lost_in_a_block_is_replaced_in_autocommit(engine: Engine) -> None:
    seed_jobs(engine, 1)
    loop = LoopConnection(engine, "jobs")
    try:
        loop.run(_terminate_inside_a_block(engine))
        left_in_block = loop.run(_mark)
        assert (left_in_block, _committed(engine)) == (False, 7), (
            "the statement after the lost connection ran inside a transaction nobody commits"
        )
    finally:
        loop.drop()


def test_a_loop_connection_connected_again_by_sqlalchemy_is_not_used_for_the_next_step(
    engine: Engine,
) -> None:
    """The net under ``_pooled``: a step whose Connection SQLAlchemy connected again by its own path (a statement
    through SQLAlchemy on an invalidated Connection) leaves a connection outside autocommit — the next step does
    not run on it."""
    seed_jobs(engine, 1)
    loop = LoopConnection(engine, "jobs")

    def connected_again(conn: Connection) -> bool:
        conn.invalidate()
        conn.exec_driver_sql("SELECT 1")  # (SQLAlchemy takes a fresh connection: no AUTOCOMMIT on it)
        return bool(conn.connection.driver_connection.autocommit)

    try:
        assert loop.run(connected_again) is False  # (the premise: SQLAlchemy's fresh connection)
        left_in_block = loop.run(_mark)
        assert (left_in_block, _committed(engine)) == (False, 7)
    finally:
        loop.drop()


def test_no_library_statement_runs_on_a_loop_connection_sqlalchemy_connected_again_within_the_step(
    engine: Engine,
) -> None:
    """Within one step (a hostile review's script): a statement's lost connection caught, then a statement
    through SQLAlchemy's own path connects again without AUTOCOMMIT (no SQLAlchemy transaction on the loop's
    Connection yet), and the Connection no longer reads as invalidated — the library's next statement must
    refuse it, not run in an implicit transaction nothing commits."""
    seed_jobs(engine, 1)
    loop = LoopConnection(engine, "jobs")

    def step(conn: Connection) -> tuple[bool, bool]:
        pid = conn.connection.driver_connection.info.backend_pid
        with engine.connect() as other:
            other.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
            other.commit()
        with pytest.raises(DBAPIError):
            run(conn, _MARK, {}, prepare=False)
        conn.execute(text("SELECT 1"))  # (SQLAlchemy's path: a fresh connection, no AUTOCOMMIT on it)
        connected_again = not conn.connection.driver_connection.autocommit
        try:
            run(conn, _MARK, {}, prepare=False)
        except DBAPIError as exc:
            return connected_again, bool(exc.connection_invalidated)
        return connected_again, False

    try:
        assert loop.run(step) == (True, True), "a library statement ran outside autocommit"
        assert _committed(engine) == 0  # (nothing ran)
        assert (loop.run(_mark), _committed(engine)) == (False, 7)
    finally:
        loop.drop()


def test_an_async_loop_connection_lost_in_a_block_is_replaced_in_autocommit(
    engine: Engine, async_url: URL
) -> None:
    seed_jobs(engine, 1)

    async def main() -> tuple[bool, int]:
        aengine = create_async_engine(async_url)
        loop = AsyncLoopConnection(aengine, "jobs")
        try:
            await loop.run(_terminate_inside_a_block(engine))
            left_in_block = await loop.run(_mark)
            return left_in_block, _committed(engine)
        finally:
            await loop.drop()
            await aengine.dispose()

    assert asyncio.run(main()) == (False, 7), (
        "the statement after the lost connection ran inside a transaction"
    )


_LOOPS_APP = "lost-connection-loops"
_TERMINATE = text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = :app")


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["async", "sync"])
def test_no_claim_is_handed_out_twice_when_limited_workers_lose_their_connections(
    engine: Engine,
    async_url: URL,
    flavour: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The workers of the reduction above: three workers (fair shares of q1/q2/q3, q3 limited to 2), 400 jobs
    deferred on their first two leases, the workers' backends terminated every 20 ms for 2.9 s at a time with
    1.5 s between, for 30 s at most; every claim a worker takes into its hands is counted by (job id,
    lease_version), which no two claims may share. Before the fix: 2-10 pairs per run (async), in every run."""
    app = {"application_name": _LOOPS_APP}

    def terminate(conn: Connection) -> None:
        conn.execute(_TERMINATE, {"app": _LOOPS_APP})

    limited_workers_losing_connections(
        engine,
        flavour,
        monkeypatch,
        caplog,
        sync_engine=lambda: create_engine(engine.url, connect_args=app),
        async_engine=lambda: create_async_engine(async_url, connect_args=app),
        terminate=terminate,
    )


def _in_hand(workers: list[Any]) -> list[dict[str, Any]]:
    """What each worker holds (a failing run's diagnostics): jobs in hand not started, claims waiting for a
    run, runs that ended while a claim was in flight, runs going on, leases held."""
    return [
        {
            "queue": [(j.id, j.lease_version) for j in list(w._queue)],
            "parked": {i: j.lease_version for i, j in dict(w._parked).items()},
            "ended_meanwhile": list(dict(w._ended_meanwhile)),
            "running": [(r.job.id, r.job.lease_version) for r in w._running_jobs()],
            "held": w._held.pairs(),
            "stopped": w._stopped(),
            "fatal": w._fatal,
        }
        for w in workers
    ]


def limited_workers_losing_connections(
    engine: Engine,
    flavour: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    *,
    sync_engine: Callable[[], Engine],
    async_engine: Callable[[], AsyncEngine],
    terminate: Callable[[Connection], None],
) -> None:
    """The run of the test above, on the workers' engine from ``sync_engine`` / ``async_engine`` (direct, or
    through a pooler); ``terminate`` (on a direct connection of ``engine``) cuts the workers' backends. Asserts
    that no (job id, lease_version) reached a worker's hands twice and that every job was done — usually in
    10-20 s, within 75 s in any case: the outages end after 30 s at the latest, and run()'s wait after a fault
    grows to 30 s (a worker holding no job has no heartbeat to end it sooner)."""
    taken: Counter[tuple[int, int]] = Counter()
    lock = threading.Lock()
    real_accept = WorkerBase._accept

    def accept(worker: Any, rows: Any) -> int:
        with lock:
            taken.update((row[0], row[1]) for row in rows)
        return real_accept(worker, rows)

    monkeypatch.setattr(WorkerBase, "_accept", accept)
    rng = random.Random(1)
    with Session(engine) as s, s.begin():
        enqueue_many(s, Job, [{"task": "t", "payload": {"i": i}, "queue": rng.choice(["q1", "q2", "q3"]),
                               "max_attempts": 100} for i in range(400)])  # fmt: skip

    def handler(job: Any) -> None:
        time.sleep(0.002)
        if job.lease_version <= 2:
            raise Defer(0.02, "twice")

    async def ahandler(job: Any) -> None:
        await asyncio.sleep(0.002)
        if job.lease_version <= 2:
            raise Defer(0.02, "twice")

    options: dict[str, Any] = dict(
        queues={"q1": 1, "q2": 2, "q3": 2}, limits={"q3": Limit(2)}, batch=1, concurrency=2, handler_timeout=0.4,
        stale_after=3.0, heartbeat=0.3, backoff=Backoff(0.01, 0.05, jitter=True), poll_interval=0.3, listen=False,
    )  # fmt: skip
    stop = threading.Event()
    cuts = 0

    def outages() -> None:
        nonlocal cuts
        with engine.connect() as conn:
            while not stop.is_set() and time.monotonic() < cut_until:
                until = time.monotonic() + 2.9
                while time.monotonic() < until and not stop.is_set():
                    terminate(conn)
                    conn.commit()
                    cuts += 1
                    time.sleep(0.02)
                stop.wait(1.5)

    def left() -> int:
        with engine.connect() as conn:
            return int(conn.execute(text("SELECT count(*) FROM jobs WHERE status <> 'done'")).scalar_one())

    hands: list[dict[str, Any]] = []
    stacks: list[str] = []
    caplog.set_level(logging.INFO, logger="sa_outbox")  # (the INFO lines about the jobs a failure names)
    began = time.monotonic()
    cut_until, deadline = began + 30, began + 75
    cutter = threading.Thread(target=outages, daemon=True)
    cutter.start()
    try:
        if flavour == "async":

            async def main() -> None:
                aengine = async_engine()
                workers = [AsyncWorker(aengine, Job, {"t": ahandler}, **options) for _ in range(3)]
                runs = [asyncio.ensure_future(w.run(install_signal_handlers=False)) for w in workers]
                while time.monotonic() < deadline and left():
                    await asyncio.sleep(0.5)
                hands.extend(_in_hand(workers))
                if left():
                    for task in asyncio.all_tasks():
                        out = io.StringIO()
                        task.print_stack(limit=12, file=out)
                        stacks.append(out.getvalue())
                for w in workers:
                    w.stop()
                await asyncio.gather(*runs, return_exceptions=True)
                await aengine.dispose()

            asyncio.run(main())
        else:
            sengine = sync_engine()
            workers = [Worker(sengine, Job, {"t": handler}, **options) for _ in range(3)]
            threads = [
                threading.Thread(target=w.run, kwargs={"install_signal_handlers": False}) for w in workers
            ]
            for t in threads:
                t.start()
            while time.monotonic() < deadline and left():
                time.sleep(0.5)
            hands.extend(_in_hand(workers))
            if left():
                frames = sys._current_frames()
                stacks.extend(
                    "".join(traceback.format_stack(frames[t.ident], limit=12)) for t in threads if t.ident
                )
            for w in workers:
                w.stop()
            for t in threads:
                t.join(30)
            for w in workers:
                w.close()
            sengine.dispose()
    finally:
        stop.set()
        cutter.join(10)
    twice = {claim: n for claim, n in taken.items() if n > 1}
    assert cuts > 0
    with engine.connect() as conn:
        unfinished = [
            (*r, sorted(lease for (job, lease) in taken if job == r[0]))
            for r in conn.execute(text(
                "SELECT id, queue, status, attempts, lease_version, locked_by, now() - locked_at, run_at - now(), "
                "last_error FROM jobs WHERE status <> 'done'"
            ))
        ]  # fmt: skip
    said = [
        f"{r.created:.3f} {r.threadName} {r.getMessage()}"
        for r in caplog.records
        if any(f"job {u[0]} " in r.getMessage() or f"job {u[0]}," in r.getMessage() for u in unfinished)
    ]
    assert not unfinished, (
        f"jobs not done after {time.monotonic() - began:.1f} s: {unfinished}; in hand: {hands}; "
        f"said of them: {said}; stacks:\n" + "\n".join(stacks)
    )
    assert len(taken) >= 400, f"the workers took only {len(taken)} claims"
    assert not twice, f"claims (job id, lease_version) handed out more than once: {twice}"
